"""``python -m kan_models.fused``: build the fused B-spline op ahead of time (as ``kanscale build-ops``)."""

from kan_models.fused.build import main

raise SystemExit(main())
