"""What makes a run the experiment it is, read from its resolved config (what ``config.yaml``
holds), for the places that compare runs: resume (is this the same experiment?) and the analysis
(are these runs repeats of one point?)."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def identity(resolved: dict[str, Any], seed: bool = True) -> dict[str, Any]:
    """A resolved config without fault injection, a test instrument (a run that failed on purpose
    is resumed without it), without ``tracking`` (where results are also sent), and without
    ``output.dir``: where a run is written is not what it is, so a run directory copied or moved
    elsewhere is the same run. ``seed=False`` leaves out ``training.seed`` too: runs that differ
    only in it are repeats of one point."""
    kept = {k: v for k, v in resolved.items() if k not in ("fault", "tracking")}
    for section, key, drop in (("output", "dir", True), ("training", "seed", not seed)):
        if drop and isinstance(kept.get(section), dict):
            kept[section] = {k: v for k, v in kept[section].items() if k != key}
    return kept


def digest(tree: dict[str, Any]) -> str:
    """A short hash of a config tree, independent of its key order."""
    return hashlib.sha256(json.dumps(tree, sort_keys=True).encode()).hexdigest()[:16]


def dotted(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping's leaves by dotted path (``training.lr``)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(dotted(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def differences(theirs: dict[str, Any], ours: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Each dotted field in which two config trees differ, with both values ("(not set)" where
    one lacks it)."""
    a, b, unset = dotted(theirs), dotted(ours), "(not set)"
    return {
        key: (a.get(key, unset), b.get(key, unset))
        for key in sorted(a.keys() | b.keys())
        if a.get(key, unset) != b.get(key, unset)
    }
