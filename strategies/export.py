"""``kanscale export``: any strategy's checkpoint -> one plain state dict plus the model config,
which ``training.init_from`` can start a run from under any other strategy.

Runs offline, in one process, without a process group: DCP checkpoints are merged with
torch.distributed.checkpoint's own converter, ZeRO checkpoints with DeepSpeed's zero_to_fp32.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from kan_models import build_model, parse_model_config
from strategies.checkpoint import Checkpoint, open_checkpoint


def consolidated_state(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """The model's full state dict, with the plain model's keys."""
    path, fmt = checkpoint.path, checkpoint.meta["format"]
    if fmt == "torch":
        return torch.load(path / "state.pt", map_location="cpu")["model"]
    if fmt == "dcp":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(path, Path(tmp) / "full.pt")
            return torch.load(Path(tmp) / "full.pt", map_location="cpu", weights_only=False)["model"]
    if fmt == "deepspeed":
        return deepspeed_state(path)
    raise ValueError(f"{path}: unknown checkpoint format {fmt!r}")


def deepspeed_state(path: Path) -> dict[str, torch.Tensor]:
    """ZeRO 1-3 keep the authoritative fp32 weights in their optimizer partitions, which
    zero_to_fp32 merges; stage 0 saves the whole module. Buffers (spline knots) come from the
    saved module either way."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from strategies.zero import DeepSpeedEngine

    tag_dir = path / DeepSpeedEngine.TAG
    # mp_rank_00_model_states.pt, or under ZeRO-3 zero_pp_rank_0_mp_rank_00_model_states.pt
    module = torch.load(sorted(tag_dir.glob("*model_states.pt"))[0], map_location="cpu", weights_only=False)["module"]
    if not any(tag_dir.glob("*optim_states.pt")) or not any(tag_dir.glob("zero_pp_rank_*")):
        return module
    state = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=DeepSpeedEngine.TAG)
    return {**{k: v for k, v in module.items() if k not in state}, **state}


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
