"""The CLI as the tests call it in their own process."""

import pytest

from launchers.cli import main


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``kanscale ARGV``; check it refused (exit 2) with one line and no traceback; the line."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err
