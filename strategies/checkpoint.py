"""Checkpoints: where they live, when one is complete, which to keep.

Each engine writes its state in its backend's own format into a directory (``Engine.save``):
plain ``torch.save`` for one process and DDP, torch.distributed.checkpoint (DCP, one shard file
per rank) for FSDP, DeepSpeed's own checkpoint for ZeRO. Around that, this module makes saving
atomic: every rank writes into ``step-NNNNNN.tmp``; once all have finished, rank 0 writes
``meta.json`` and renames the directory to ``step-NNNNNN``. A checkpoint directory without the
suffix and with ``meta.json`` is complete; anything else (a crash mid-save) is ignored and
cleaned up by the next save. Only the newest ``keep`` complete checkpoints are kept.

A run's state between steps is the model and optimizer state, the step count (the data order
is a function of the seed and the step), and each rank's random generator state, saved as
``rng-rank<R>.pt`` beside the backend's files.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from strategies.distributed import DistEnv

STEP_DIR = re.compile(r"^step-(\d{6,})$")
META_FILE = "meta.json"


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    meta: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.meta["step"])


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def complete_checkpoints(run_dir: Path) -> list[Checkpoint]:
    """Complete checkpoints of a run, oldest first."""
    found = []
    root = checkpoints_dir(run_dir)
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        if STEP_DIR.match(path.name) and (path / META_FILE).is_file():
            found.append(Checkpoint(path, json.loads((path / META_FILE).read_text())))
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(run_dir: Path) -> Checkpoint | None:
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def open_checkpoint(path: Path) -> Checkpoint:
    """A checkpoint directory, or a run directory (its latest complete checkpoint)."""
    path = Path(path)
    if (path / META_FILE).is_file():
        return Checkpoint(path, json.loads((path / META_FILE).read_text()))
    latest = latest_checkpoint(path)
    if latest is None:
        raise FileNotFoundError(f"{path}: no complete checkpoint here (a checkpoint directory has {META_FILE})")
    return latest


def save_checkpoint(engine: Any, env: DistEnv, run_dir: Path, step: int, meta: dict[str, Any], keep: int) -> Path:
    """Write a complete checkpoint of ``engine`` after ``step`` steps (every rank calls this)."""
    final = checkpoints_dir(run_dir) / f"step-{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    env.barrier()
    engine.save(tmp)
    torch.save(torch.get_rng_state(), tmp / f"rng-rank{env.rank}.pt")
    env.barrier()
    if env.is_main:
        (tmp / META_FILE).write_text(json.dumps({**meta, "step": step, "format": engine.checkpoint_format,
                                                 "world_size": env.world_size}, indent=2, default=str))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        prune(run_dir, keep)
    env.barrier()
    return final


def prune(run_dir: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints, and leftovers of failed saves."""
    for old in complete_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old.path, ignore_errors=True)
    for leftover in checkpoints_dir(run_dir).glob("*.tmp"):
        shutil.rmtree(leftover, ignore_errors=True)


def load_checkpoint(engine: Any, env: DistEnv, checkpoint: Checkpoint) -> None:
    if checkpoint.meta["format"] != engine.checkpoint_format:
        raise ValueError(f"{checkpoint.path} is a {checkpoint.meta['format']} checkpoint but this strategy reads "
                         f"{engine.checkpoint_format}; resume with the strategy that wrote it, or start a new run from "
                         "`kanscale export` output with training.init_from")
    if checkpoint.meta["world_size"] != env.world_size:
        raise ValueError(f"{checkpoint.path} was written by {checkpoint.meta['world_size']} ranks, this run has "
                         f"{env.world_size}; resume with the same world size, or export and use training.init_from")
    engine.load(checkpoint.path)
    rng = checkpoint.path / f"rng-rank{env.rank}.pt"
    if rng.exists():
        torch.set_rng_state(torch.load(rng))
