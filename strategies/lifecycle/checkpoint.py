"""Checkpoints: where they live, when one is complete, which to keep.

Each engine writes its state in its backend's own format into a directory (``Engine.save``):
plain ``torch.save`` for one process and DDP, torch.distributed.checkpoint (DCP, one shard file
per rank) for FSDP, DeepSpeed's own checkpoint for ZeRO. Around that, this module makes saving
atomic: every rank writes into ``step-NNNNNN.tmp``; once all have finished, rank 0 writes
``meta.json`` and renames the directory to ``step-NNNNNN``. A checkpoint directory without the
suffix and with ``meta.json`` is complete; anything else (a crash mid-save) is ignored and
cleaned up by the next save. Only the newest ``keep`` complete checkpoints are kept.

``meta.json`` is the checkpoint's manifest: besides the step, format and world size it holds the
sha256 of every file in the directory (``files``), computed by rank 0 once every rank has written.
A resume verifies them before it changes anything (:func:`usable_checkpoint`) and falls back to
the newest checkpoint that verifies; ``kanscale export`` reads a checkpoint only through the same
function (strategies/lifecycle/export.py). Checkpoints written before the manifest had checksums
are used unverified, as they were before: they were written as atomically as today's.

A run's state between steps is the model and optimizer state, the step count (the data order
is a function of the seed and the step), and each rank's random generator state, saved as
``rng-rank<R>.pt`` beside the backend's files.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from strategies.lifecycle.disk import disk_full
from strategies.runtime.distributed import DistEnv
from strategies.torch_files import load_plain

STEP_DIR = re.compile(r"^step-(\d{6,})$")
META_FILE = "meta.json"
PARTIAL = ".tmp"  # a save in progress, or one that died: never read
SET_ASIDE = re.compile(r"^step-\d{6,}\.corrupt(-\d+)?$")  # failed verification (set_aside): never read


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    meta: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    @property
    def verifiable(self) -> bool:
        """Whether its manifest has checksums (checkpoints written before they existed have none)."""
        return isinstance(self.meta.get("files"), dict)


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def read_meta(path: Path) -> dict[str, Any] | None:
    """A checkpoint directory's manifest, or None where it is missing or unreadable."""
    try:
        meta = json.loads((Path(path) / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and isinstance(meta.get("step"), int) else None


def _step_dirs(run_dir: Path) -> list[Path]:
    """The checkpoint directories a save completed (named step-N, with a manifest), oldest first."""
    root = checkpoints_dir(run_dir)
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / META_FILE).is_file()] if root.is_dir() else []
    return sorted(found, key=lambda p: int(p.name.removeprefix("step-")))  # the number STEP_DIR matched


def complete_checkpoints(run_dir: Path) -> list[Checkpoint]:
    """Complete checkpoints of a run, oldest first (one whose manifest cannot be read is not)."""
    return [Checkpoint(path, meta) for path in _step_dirs(run_dir) if (meta := read_meta(path)) is not None]


def latest_checkpoint(run_dir: Path) -> Checkpoint | None:
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def save_checkpoint(engine: Any, env: DistEnv, run_dir: Path, step: int, meta: dict[str, Any], keep: int) -> Path:
    """Write a complete checkpoint of ``engine`` after ``step`` steps (every rank calls this). A
    save that fails for a full disk raises :class:`DiskFull` naming the partial checkpoint; that
    is deleted when the run ends (``Attempt.release``), not here, where other ranks may still be
    writing into it and a rank failing on a vanished directory would blur which failure came first."""
    final = checkpoints_dir(run_dir) / f"step-{step:06d}"
    tmp = final.with_name(final.name + PARTIAL)
    try:
        if env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        env.barrier()
        engine.save(tmp)
        torch.save(torch.get_rng_state(), tmp / f"rng-rank{env.rank}.pt")
        env.barrier()
        if env.is_main:
            (tmp / META_FILE).write_text(
                json.dumps(
                    {
                        **meta,
                        "step": step,
                        "format": engine.checkpoint_format,
                        "world_size": env.world_size,
                        "files": file_digests(tmp),
                    },
                    indent=2,
                    default=str,
                )
            )
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            prune(run_dir, keep)
    except BaseException as err:
        full = disk_full(err, tmp, "checkpoint")
        if full is err:
            raise
        raise full from err
    env.barrier()
    return final


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_digests(directory: Path) -> dict[str, str]:
    """The sha256 of every file under a checkpoint directory but its manifest, by relative path."""
    return {
        p.relative_to(directory).as_posix(): _sha256(p)
        for p in sorted(Path(directory).rglob("*"))
        if p.is_file() and p.relative_to(directory).as_posix() != META_FILE
    }


def verify(checkpoint: Checkpoint) -> str | None:
    """Why a complete checkpoint cannot be trusted, or None: its manifest names another step than
    its directory, or a file it lists is missing or differs from its checksum. Files the manifest
    does not list are not looked at. A checkpoint without checksums passes (see the docstring)."""
    if checkpoint.path.name != f"step-{checkpoint.step:06d}":
        return (
            f"its {META_FILE} says step {checkpoint.step}, not the step of its name (its save named it "
            f"step-{checkpoint.step:06d})"
        )
    for name, expected in (checkpoint.meta["files"] if checkpoint.verifiable else {}).items():
        path = checkpoint.path / name
        if not path.is_file():
            return f"{name} is missing"
        if _sha256(path) != expected:
            return f"{name} does not match its checksum (truncated or altered since it was saved)"
    return None


@dataclass(frozen=True)
class PassedOver:
    """A complete checkpoint a resume did not use, and why."""

    path: Path
    why: str
    corrupt: bool  # it failed verification (else it is sound, but its steps' records are missing)


def verified(path: Path) -> Checkpoint | str:
    """The checkpoint in ``path`` if it can be trusted, else why not: its manifest cannot be read,
    or :func:`verify` finds a problem. What a resume and an export both go by."""
    meta = read_meta(path)
    if meta is None:
        return f"its {META_FILE} cannot be read"
    checkpoint = Checkpoint(path, meta)
    return verify(checkpoint) or checkpoint


def usable_checkpoint(run_dir: Path, steps_recorded: int | None) -> tuple[Checkpoint | None, list[PassedOver]]:
    """The newest complete checkpoint that verifies and, for a resume (``steps_recorded``, the
    steps in steps.jsonl; None for an export, which reads the model only), whose steps are all
    recorded (a resume keeps the records of the steps before it); and each newer one passed over."""
    passed_over = []
    for path in reversed(_step_dirs(run_dir)):
        found = verified(path)
        if isinstance(found, str):
            passed_over.append(PassedOver(path, found, corrupt=True))
        elif steps_recorded is not None and found.step > steps_recorded:
            passed_over.append(
                PassedOver(path, f"steps.jsonl holds only {steps_recorded} of its {found.step} steps", corrupt=False)
            )
        else:
            return found, passed_over
    return None, passed_over


def set_aside(path: Path) -> Path:
    """Rename a corrupt checkpoint to ``step-N.corrupt`` (``.corrupt-2``, ... if taken): no longer a
    checkpoint anything reads or prunes, and still there to look at."""
    target, n = path.with_name(path.name + ".corrupt"), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.corrupt-{n}")
    path.rename(target)
    return target


def prune(run_dir: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints, and leftovers of failed saves."""
    for old in complete_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old.path, ignore_errors=True)
    discard_partial_saves(run_dir)


def discard_partial_saves(run_dir: Path) -> None:
    """Delete what saves that did not complete left (``step-N.tmp``): after a save, and when a run
    ends (rank 0, once its failure is recorded: a full disk leaves a partial checkpoint behind)."""
    for leftover in checkpoints_dir(run_dir).glob(f"*{PARTIAL}"):
        shutil.rmtree(leftover, ignore_errors=True)


def load_checkpoint(engine: Any, env: DistEnv, checkpoint: Checkpoint) -> None:
    if checkpoint.meta["format"] != engine.checkpoint_format:
        raise ValueError(
            f"{checkpoint.path} is a {checkpoint.meta['format']} checkpoint but this strategy reads "
            f"{engine.checkpoint_format}; resume with the strategy that wrote it, or start a new run from "
            "`kanscale export` output with training.init_from"
        )
    if checkpoint.meta["world_size"] != env.world_size:
        raise ValueError(
            f"{checkpoint.path} was written by {checkpoint.meta['world_size']} ranks, this run has "
            f"{env.world_size}; resume with the same world size, or export and use training.init_from"
        )
    engine.load(checkpoint.path)
    rng = checkpoint.path / f"rng-rank{env.rank}.pt"
    if rng.exists():
        torch.set_rng_state(load_plain(rng, "cpu", "checkpoint file"))
