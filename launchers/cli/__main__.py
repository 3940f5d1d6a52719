"""``python -m launchers.cli``: what every rank of a launch runs."""

import sys

from launchers.cli import main

sys.exit(main())
