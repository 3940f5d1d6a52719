"""``kanscale export``: any strategy's checkpoint -> one plain state dict plus the model config,
which ``training.init_from`` can start a run from under any other strategy.

Runs offline, in one process, without a process group: the engine class that writes a format
also merges it (``consolidate``): DCP checkpoints with torch.distributed.checkpoint's own
converter, ZeRO checkpoints with DeepSpeed's zero_to_fp32.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kan_models import build_model, parse_model_config
from strategies.checkpoint import Checkpoint, open_checkpoint
from strategies.registry import CHECKPOINT_FORMATS


def consolidated_state(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """The model's full state dict, with the plain model's keys, merged by the engine class that
    writes the checkpoint's format."""
    consolidate = CHECKPOINT_FORMATS.get(checkpoint.meta["format"])
    if consolidate is None:
        raise ValueError(f"{checkpoint.path}: unknown checkpoint format {checkpoint.meta['format']!r}; "
                         f"this kanscale reads {', '.join(CHECKPOINT_FORMATS)}")
    return consolidate(checkpoint.path)


def export(checkpoint_path: str | Path, out: str | Path) -> tuple[Path, Checkpoint]:
    """Write ``out``: {"model_state", "model" (its config), "source"}; checked by loading the
    state into a freshly built model, so an incomplete conversion fails here, not later."""
    checkpoint = open_checkpoint(Path(checkpoint_path))
    state = consolidated_state(checkpoint)
    model_config = checkpoint.meta["config"]["model"]
    dtype = getattr(torch, checkpoint.meta["config"]["training"]["dtype"])
    model = build_model(parse_model_config(model_config), seed=0).to(dtype)
    model.load_state_dict(state)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model_state": model.state_dict(), "model": model_config,
                "source": {k: checkpoint.meta[k] for k in ("run_id", "step", "strategy", "format", "world_size")}}, out)
    return out, checkpoint
