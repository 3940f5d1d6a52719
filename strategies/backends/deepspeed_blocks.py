"""The blocks of a native DeepSpeed file as the suite reads them. Transformers' templates write
some whole blocks as ``"auto"`` (``"params": "auto"``; ``"fp16": "auto"``): those are read as the
block with every key left to the experiment. Any other block that is not a mapping (a ZeRO stage
the suite would have to guess, an offload target) is named with its fix, every such block of the
file in one refusal, before anything else reads the file."""

from __future__ import annotations

import copy
import json
from typing import Any

AUTO = "auto"
KeyPath = tuple[str, ...]

# blocks that "auto" stands for whole: the block with every key "auto"
AUTO_BLOCKS: dict[KeyPath, dict[str, Any]] = {
    ("optimizer", "params"): {},
    ("scheduler", "params"): {},
    ("fp16",): {"enabled": AUTO},
    ("bf16",): {"enabled": AUTO},
}
# blocks that are mappings where given, each with what to write
WHOLE_AUTO = {("optimizer",), ("scheduler",)}  # may be "auto" whole: the experiment's
BLOCKS: dict[KeyPath, str] = {
    ("optimizer",): '{"type": "AdamW", "params": {...}}, or "auto"',
    ("scheduler",): '{"type": "WarmupLR", "params": {...}}, or "auto"',
    ("optimizer", "params"): '{"lr": "auto", ...}',
    ("scheduler", "params"): '{"warmup_num_steps": "auto", ...}',
    ("fp16",): '{"enabled": "auto"}',
    ("bf16",): '{"enabled": "auto"}',
    ("zero_optimization",): '{"stage": 0, 1, 2 or 3, ...} (the suite does not choose a ZeRO stage)',
    ("zero_optimization", "offload_optimizer"): '{"device": "cpu"}, or leave it out',
    ("zero_optimization", "offload_param"): '{"device": "cpu"}, or leave it out',
}


def _parent(tree: dict[str, Any], path: KeyPath) -> dict[str, Any] | None:
    for key in path[:-1]:
        tree = tree.get(key)  # type: ignore[assignment]
        if not isinstance(tree, dict):
            return None
    return tree


def as_blocks(native: dict[str, Any], source: str) -> tuple[dict[str, Any], list[str]]:
    """A copy of ``native`` with each whole-block ``"auto"`` read as its block, and each block that
    is not a mapping named (with what to write in ``source``) and left out of the copy."""
    native = copy.deepcopy(native)
    problems = []
    for path in BLOCKS:  # parents first: a block left out is not looked into
        parent = _parent(native, path)
        if parent is None or path[-1] not in parent:
            continue
        value = parent[path[-1]]
        if value == AUTO and path in AUTO_BLOCKS:
            parent[path[-1]] = copy.deepcopy(AUTO_BLOCKS[path])
        elif not isinstance(value, dict) and not (value == AUTO and path in WHOLE_AUTO):
            problems.append(
                f"{'.'.join(path)} is {json.dumps(value)}, not a block of keys; in {source} write {BLOCKS[path]}"
            )
            del parent[path[-1]]
    return native, problems
