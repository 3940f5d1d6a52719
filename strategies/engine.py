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

import torch
from torch import nn

from analysis.schema import ModelStateBytes
from strategies.config import Section, TrainingConfig
from strategies.distributed import DistEnv


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


class Engine:
    """Model + optimizer under one strategy. Subclasses override what their backend does
    differently; the defaults are plain single-process PyTorch."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, training: TrainingConfig) -> None:
        self.model = model
        self.optimizer = optimizer
        self.training = training

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
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def model_state_bytes(self) -> ModelStateBytes:
        """Bytes of parameters, gradients and optimizer state this rank holds right now."""
        params = list(self.model.parameters())
        return ModelStateBytes(
            params=tensor_bytes(params),
            grads=tensor_bytes(p.grad for p in params if p.grad is not None),
            optimizer=tensor_bytes(optimizer_state_tensors(self.optimizer)),
        )

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state as a plain (unsharded, unwrapped) state dict."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    @torch.no_grad()
    def update_grid(self, x: torch.Tensor) -> None:
        """Refit the KAN grids to the activations of x."""
        self.model.update_grid(x)


class StrategyConfig(Section):
    """A strategy's options, validated from the experiment's ``strategy`` section. Each backend
    subclasses it, narrows ``name`` to a literal and implements :meth:`apply`."""

    name: str

    def apply(self, model: nn.Module, training: TrainingConfig, env: DistEnv) -> Engine:
        """Wrap ``model`` (already on ``env.device``) and build its optimizer."""
        raise NotImplementedError
