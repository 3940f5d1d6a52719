"""Reading torch files without unpickling: every checkpoint and export the suite reads goes through
``torch.load(weights_only=True)``, which rebuilds tensors and plain containers only. A file that
holds anything else is refused naming the file and what it held, never with torch's own advice to
load it with ``weights_only=False`` (which would run whatever the file's author put in it)."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import torch

from kanscale.errors import ConfigError

NOT_PLAIN = "kanscale loads such files with torch.load(weights_only=True) and never unpickles them"


def why_not_loaded(err: Exception, limit: int = 300) -> str:
    """The line of torch.load's error that says what was refused (its weights-only refusal runs
    to a page of advice, including to load with weights_only=False), cut to ``limit`` characters."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if isinstance(err, pickle.UnpicklingError) and lines and lines[0].startswith("Weights only load failed"):
        details = [
            line
            for line in lines[1:]
            if not line.startswith(("Check the documentation", "Please file an issue")) and "weights_only" not in line
        ]
        text = details[0] if details else "it holds Python objects"
    else:
        text = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def load_weights_only(path: str | Path, map_location: Any) -> Any:
    """``torch.load(weights_only=True)``, its notices (e.g. "Detected pickle protocol 4") left out:
    a refusal built from its error says what matters."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.load(path, map_location=map_location, weights_only=True)


def load_plain(path: Path, map_location: Any, what: str) -> Any:
    """``path`` read with ``weights_only=True``; a ConfigError naming it (``what``: the file's part,
    e.g. "checkpoint file") and why it was not loaded otherwise."""
    try:
        return load_weights_only(path, map_location)
    except Exception as err:
        raise ConfigError(
            f"{what} {path} was not loaded: {why_not_loaded(err)}; {NOT_PLAIN}. Resume from a checkpoint this "
            "suite wrote, or start afresh"
        ) from None
