"""A command's results as a JSON document with its Markdown twin next to it (``X.json`` and
``X.md``), the way ``kanscale bench``, ``commbench`` and ``project`` write them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kanscale.errors import ConfigError
from kanscale.writes import atomic_write_text


def json_out(out: str | Path, flag: str = "--out") -> Path:
    """The JSON path a command was given; ConfigError naming ``flag`` unless it ends in .json
    (the Markdown goes next to it as .md, so any other name could be overwritten by it). Check
    it before the work, so that a bad name does not cost the run."""
    path = Path(out)
    if path.suffix != ".json":
        raise ConfigError(f"{flag}: give a .json file (the Markdown table goes next to it as .md), got {out}")
    return path


def write_json_and_markdown(out: str | Path, doc: dict[str, Any], markdown: str, flag: str = "--out") -> Path:
    """Write ``doc`` as indented JSON to ``out`` and ``markdown`` next to it as .md, creating the
    directory; returns the Markdown's path."""
    path = json_out(out, flag)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(doc, indent=2) + "\n")
    twin = path.with_suffix(".md")
    atomic_write_text(twin, markdown)
    return twin
