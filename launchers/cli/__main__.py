"""``python -m launchers.cli``, what every rank of a launch runs, and the ``kanscale`` console
script: the process settings every command of the suite runs with, then the command."""

import sys

from kanscale.extensions import keep_builds_in_environment
from kanscale.warnings_once import show_warnings_once
from launchers.cli import main


def run() -> int:
    keep_builds_in_environment()  # before any rank starts: they inherit it
    show_warnings_once()
    return main()


if __name__ == "__main__":
    sys.exit(run())
