"""``kanscale export``: any strategy's checkpoint -> one plain state dict plus the model config,
which ``training.init_from`` can start a run from under any other strategy.

Runs offline, in one process, without a process group: the engine class that writes a format
also merges it (``consolidate``): DCP checkpoints with torch.distributed.checkpoint's own
converter, ZeRO checkpoints with DeepSpeed's zero_to_fp32.

Which checkpoint it reads is decided by the verification a resume uses (:func:`usable_checkpoint`,
strategies/lifecycle/checkpoint.py): of a run directory, the newest checkpoint that verifies, each
newer one named on stderr with why it was skipped (and left in place: an export changes nothing in
a run; a resume sets such checkpoints aside); a checkpoint directory given by name, only if it
verifies. A directory set aside as corrupt (``.corrupt``), a save that did not complete (``.tmp``)
and one without a readable manifest are never read.

An export holds tensors and plain data only (the model config as JSON types), so it is read
with ``torch.load(weights_only=True)``, which cannot run code: kanscale never unpickles a file
a user hands it (:func:`read_export`). What is not of that form is refused.

An export never writes into what it reads: an ``--out`` inside the run directory (or the
checkpoint directory, for one outside a run) is refused, symlinks resolved, before the checkpoint
is loaded; and the file is written beside its place and renamed onto it, so a reader (or a failed
export) never leaves a half-written file under that name.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from kan_models import build_model, parse_model_config
from kanscale import log
from kanscale.errors import ConfigError
from kanscale.writes import new_temp_file
from strategies.lifecycle.checkpoint import (
    META_FILE,
    PARTIAL,
    SET_ASIDE,
    STEP_DIR,
    Checkpoint,
    usable_checkpoint,
    verified,
)
from strategies.registry import CHECKPOINT_FORMATS
from strategies.torch_files import NOT_PLAIN, load_weights_only, why_not_loaded

logger = log.get(__name__)


def checkpoint_to_export(path: Path) -> Checkpoint:
    """The checkpoint ``kanscale export`` reads from ``path``, a run directory or a checkpoint
    directory (see the module docstring); a ConfigError naming the directory, why and what to do
    where there is none it can trust."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(
            f"export: {path} does not exist; give a run directory or one of its checkpoints "
            "(RUN_DIR/checkpoints/step-NNNNNN)"
        )
    checkpoint: Checkpoint | None
    if (path / META_FILE).exists() or path.name.startswith("step-"):
        checkpoint = _named_checkpoint(path)
    else:
        checkpoint, passed_over = usable_checkpoint(path, steps_recorded=None)
        if checkpoint is None and not passed_over:
            raise ConfigError(
                f"export: {path}: no complete checkpoint here (a checkpoint directory has {META_FILE}); "
                "give a run directory written with training.checkpoint_every, or one of its checkpoints"
            )
        if checkpoint is None:
            raise ConfigError(
                f"export: {path} has no checkpoint that verifies ("
                + "; ".join(f"{p.path.name}: {p.why}" for p in passed_over)
                + "); none of it can be exported: train it again (a checkpoint that fails verification "
                "is never read)"
            )
        for p in passed_over:
            logger.warning(f"kanscale: export {path}: skipped {p.path.name} ({p.why}; left in place)")
        if passed_over:
            logger.info(
                f"kanscale: export {path}: exporting {checkpoint.path.name}, the newest checkpoint that verifies"
            )
    if not checkpoint.verifiable:
        logger.warning(
            f"kanscale: export: {checkpoint.path} was written without checksums (by an earlier kanscale) and is "
            "read unverified"
        )
    return checkpoint


def _named_checkpoint(path: Path) -> Checkpoint:
    """A checkpoint directory given by name: read only if it is a complete one that verifies."""
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else None
    instead = (
        f"export the run directory {run_dir} instead, which takes its newest checkpoint that verifies"
        if run_dir is not None
        else "export the run directory it belongs to, or another checkpoint"
    )
    if SET_ASIDE.match(path.name):
        raise ConfigError(
            f"export: {path} was set aside by a resume because it failed verification (a .corrupt "
            f"checkpoint is never read); {instead}"
        )
    if path.name.endswith(PARTIAL) or (not STEP_DIR.match(path.name) and not (path / META_FILE).exists()):
        raise ConfigError(
            f"export: {path} is no complete checkpoint (a save that did not finish, ending in {PARTIAL}, "
            f"or without {META_FILE}: never read); {instead}"
        )
    found = verified(path)
    if isinstance(found, str):
        raise ConfigError(f"export: {path} fails verification: {found}; {instead}")
    return found


def refuse_out_inside(out: Path, checkpoint: Checkpoint) -> None:
    """Refuse an ``out`` inside the run directory ``checkpoint`` belongs to (or inside the
    checkpoint directory itself, for one outside a run), symlinks resolved: writing there would
    replace or add to files the export reads and a resume verifies (a checkpoint's own state.pt)."""
    source = checkpoint.path.resolve()
    protected = source.parent.parent if source.parent.name == "checkpoints" else source
    where = Path(out).resolve()
    if where == protected or protected in where.parents:
        what = "run directory" if protected != source else "checkpoint"
        raise ConfigError(
            f"--out: {out} lies inside the {what} being exported ({protected}), where it would overwrite "
            "or add to the files it is read from; write the export outside it, e.g. --out "
            f"{protected.parent / (protected.name + '.pt')}"
        )


def consolidated_state(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """The model's full state dict, with the plain model's keys, merged by the engine class that
    writes the checkpoint's format. A torch-format file holding Python objects is refused: the
    suite reads its own torch checkpoints with weights_only=True too."""
    consolidate = CHECKPOINT_FORMATS.get(checkpoint.meta["format"])
    if consolidate is None:
        raise ValueError(
            f"{checkpoint.path}: unknown checkpoint format {checkpoint.meta['format']!r}; "
            f"this kanscale reads {', '.join(CHECKPOINT_FORMATS)}"
        )
    try:
        return consolidate(checkpoint.path)
    except pickle.UnpicklingError as err:
        raise ConfigError(
            f"export: {checkpoint.path} holds a file that is not a kanscale checkpoint, or holds Python "
            f"objects ({why_not_loaded(err)}); {NOT_PLAIN}"
        ) from None


def export(checkpoint_path: str | Path, out: str | Path) -> tuple[Path, Checkpoint]:
    """Write ``out``: {"model_state", "model" (its config), "source"}; checked by loading the
    state into a freshly built model, so an incomplete conversion fails here, not later."""
    checkpoint = checkpoint_to_export(Path(checkpoint_path))
    refuse_out_inside(Path(out), checkpoint)
    state = consolidated_state(checkpoint)
    # through JSON: the config and the source are stored as plain data, which weights_only reads
    model_config = json.loads(json.dumps(checkpoint.meta["config"]["model"]))
    dtype = getattr(torch, checkpoint.meta["config"]["training"]["dtype"])
    model = build_model(parse_model_config(model_config), seed=0).to(dtype)
    model.load_state_dict(state)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    source = json.loads(
        json.dumps({k: checkpoint.meta[k] for k in ("run_id", "step", "strategy", "format", "world_size")}, default=str)
    )
    fd, tmp = new_temp_file(out)  # beside out, renamed onto it once complete (as run records are written)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"model_state": model.state_dict(), "model": model_config, "source": source}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out, checkpoint


def read_export(path: str | Path, field: str) -> dict[str, Any]:
    """A ``kanscale export`` file, read with ``weights_only=True``: ``{"model_state": {name:
    tensor}, "model": {...}, "source": {...}}``. Anything else (another pickle, a file holding
    Python objects, no torch file at all) is a ConfigError naming ``field``, the file and why."""

    def refused(reason: str) -> ConfigError:
        return ConfigError(
            f"{field}: {path} is not a kanscale export, or it holds Python objects ({reason}); {NOT_PLAIN}; "
            "give a file written by kanscale export"
        )

    try:
        exported = load_weights_only(path, "cpu")
    except Exception as err:
        raise refused(why_not_loaded(err)) from None
    state = exported.get("model_state") if isinstance(exported, dict) else None
    if (
        not isinstance(state, dict)
        or not isinstance(exported.get("model"), dict)
        or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items())
    ):
        raise refused("it loads, but holds no model_state of tensors beside a model config")
    return exported
