"""Sharded checkpoints with torch.distributed.checkpoint (DCP): each rank writes and reads only
its own shards, the format FSDP1, FSDP2 and tensor parallelism are meant to be saved in; and the
whole-model state dicts of models whose parameters are DTensors."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from strategies.step.engine import detached_copy


def torch_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer under a wrapper (Accelerate's AcceleratedOptimizer has ``.optimizer``)."""
    return getattr(optimizer, "optimizer", optimizer)


def save_dcp(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    model_state, optimizer_state = get_state_dict(model, torch_optimizer(optimizer))
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory)


def load_dcp(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Load in place. The optimizer's hyperparameters (``param_groups``) are not read back: a
    resumed run has the same experiment config, so the freshly built optimizer's are the saved
    ones. Reading them is also what breaks: in torch 2.13, a rank other than the coordinator
    flattens that list of dicts into one key the checkpoint does not have ("Missing key in
    checkpoint state_dict: optimizer.param_groups", with FSDP1 in a fresh process)."""
    model_state, optimizer_state = get_state_dict(model, torch_optimizer(optimizer))
    state: dict[str, dict[str, Any]] = {"model": model_state, "optimizer": {"state": optimizer_state["state"]}}
    dcp.load(state, checkpoint_id=directory)
    optimizer_state["state"] = state["optimizer"]["state"]
    set_state_dict(model, torch_optimizer(optimizer), model_state_dict=state["model"], optim_state_dict=optimizer_state)


class ShardedCheckpoints:
    """Engine mixin: checkpoints in DCP's sharded format (each rank its own shards)."""

    checkpoint_format = "dcp"
    model: nn.Module
    optimizer: torch.optim.Optimizer

    def save(self, directory: Path) -> None:
        save_dcp(self.model, self.optimizer, directory)

    def load(self, directory: Path) -> None:
        load_dcp(self.model, self.optimizer, directory)

    @staticmethod
    def consolidate(directory: Path) -> dict[str, torch.Tensor]:
        """Merge the shards with torch.distributed.checkpoint's own converter."""
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(directory, Path(tmp) / "full.pt")
            return torch.load(Path(tmp) / "full.pt", map_location="cpu", weights_only=False)["model"]


class DTensorStateDicts:
    """Engine mixin for models whose parameters are DTensors (FSDP2, tensor parallel, both): the
    whole state gathered on every rank, and loaded back into the shards."""

    model: nn.Module

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        state = self.model.state_dict()
        return detached_copy({k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()})

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        # torch types the argument as an invariant dict of its value union; a dict of tensors is one
        set_model_state_dict(self.model, cast(dict[str, Any], state), options=StateDictOptions(full_state_dict=True))
