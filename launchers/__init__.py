"""HOW ranks are started: the ``kanscale`` CLI and (later) launcher command builders and sweeps."""
