"""The one small interface every strategy implements.

A strategy wraps a model and its optimizer into an :class:`Engine`. The training loop only
calls what is defined here, so it never needs to know which backend is underneath:

    for i, (x, y) in enumerate(micro_batches):
        with engine.gradient_sync(i == last):
            engine.backward(loss_fn(engine.model(x), y))
    engine.step()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from analysis.schema import ModelStateBytes
from strategies.config import Section, TrainingConfig
from strategies.distributed import DistEnv


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of a tensor this rank holds: a DTensor's local shard, else the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank holds for these (possibly sharded) tensors."""
    return sum(local(t).numel() * t.element_size() for t in tensors)


def frozen_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters that never train. The FSDP strategies leave them whole on every rank: there is
    nothing to gain from sharding them, and pykan keeps its frozen affine constants in plain
    Python lists besides the module, which would go on pointing at the unsharded originals."""
    return [p for p in model.parameters() if not p.requires_grad]


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class Engine:
    """Model + optimizer under one strategy. Subclasses override what their backend does
    differently; the defaults are plain single-process PyTorch."""

    # How :meth:`save` writes (see strategies/checkpoint.py and `kanscale export`).
    checkpoint_format = "torch"

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, training: TrainingConfig) -> None:
        self.model = model
        self.optimizer = optimizer
        self.training = training
        # Model-state bytes are counted once, in a step, after the gradients exist and before the
        # update frees them: the loop arms the count, the engine takes it at that point.
        self.count_state_next_step = False
        self.counted_state: ModelStateBytes | None = None

    def _count_state_if_armed(self) -> None:
        if self.count_state_next_step:
            self.counted_state = self.model_state_bytes()
            self.count_state_next_step = False

    def gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-step; ``enabled`` is False for all but the last micro-step of a
        gradient-accumulation window, so backends can skip synchronizing gradients there."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """``loss`` is this rank's share of the global-batch mean loss: the sum over all ranks
        and micro-steps of these shares is the global mean. Backends that average gradients
        over ranks (or over accumulation steps) rescale it here so the gradient is exactly that
        of the global mean."""
        loss.backward()

    def clip_grad_norm(self, max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def step(self) -> None:
        """Clip (if configured), update the parameters, clear the gradients."""
        if self.training.grad_clip > 0:
            self.clip_grad_norm(self.training.grad_clip)
        self._count_state_if_armed()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def model_state_bytes(self) -> ModelStateBytes:
        """Bytes of parameters, gradients and optimizer state this rank holds right now (the
        local shards of sharded tensors: FSDP1's flat parameters, FSDP2's DTensors)."""
        params = list(self.model.parameters())
        return ModelStateBytes(
            params=tensor_bytes(params),
            grads=tensor_bytes(p.grad for p in params if p.grad is not None),
            optimizer=tensor_bytes(optimizer_state_tensors(self.optimizer)),
        )

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state as a plain state dict with the unwrapped model's keys, on
        every rank. Sharded engines gather it, so every rank must call this together."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Replace the model's state with ``state`` (as :meth:`full_state_dict` returns it),
        re-sharding where the engine shards. Every rank calls this with the same state."""
        self.model.load_state_dict(state)

    def save(self, directory: Path) -> None:
        """Write the model and optimizer state into ``directory`` (every rank calls this). The
        default: rank 0 writes one ``torch.save`` file; every rank holds the same state."""
        if is_rank0():
            torch.save({"model": self.full_state_dict(), "optimizer": self.optimizer.state_dict()}, directory / "state.pt")

    def load(self, directory: Path) -> None:
        state = torch.load(directory / "state.pt", map_location=next(self.model.parameters()).device)
        self.load_full_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def distributed_type(self) -> str | None:
        """What the backend says it is running, where that can differ from what was asked
        (Accelerate picks it from its launch config)."""
        return None

    def backend_config(self) -> dict | None:
        """The backend's own resolved configuration, where it has one (DeepSpeed's JSON)."""
        return None


class AveragingEngine(Engine):
    """An engine whose backend averages gradients over ranks (DDP, FSDP): the rank's share of
    the loss is scaled by the world size, so the average is the gradient of the global mean."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, training: TrainingConfig, world_size: int) -> None:
        super().__init__(model, optimizer, training)
        self.world_size = world_size

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.world_size).backward()


class StrategyConfig(Section):
    """A strategy's options, validated from the experiment's ``strategy`` section. Each backend
    subclasses it, narrows ``name`` to a literal and implements :meth:`apply`."""

    name: str
    # Every strategy but ``single`` runs inside a process group, a one-rank group included.
    needs_process_group: ClassVar[bool] = True

    def preflight(self, training: TrainingConfig, device_type: str, world_size: int) -> None:
        """Refuse, before any process starts, what cannot run on ``device_type`` (``cpu`` or
        ``cuda``) at ``world_size``; raise :class:`ConfigError` naming the option and the fix."""

    def apply(self, model: nn.Module, training: TrainingConfig, env: DistEnv) -> Engine:
        """Wrap ``model`` (already on ``env.device``, same initial state on every rank) and
        build its optimizer."""
        raise NotImplementedError
