"""``training.compile: step``: an engine's whole step compiled, not only its model.

Three parts, each the way PyTorch documents it:

- the forward pass and the loss as one graph (``torch.compile``), whose backward AOTAutograd
  compiles with it;
- the backward pass run by compiled autograd, which captures the whole autograd graph of the
  call, the gradient hooks a backend registers included (DDP's reducer, as its Python reducer);
- the optimizer step (``torch.compile(optimizer.step)``): one generated kernel for every
  parameter's update, where eager Adam loops over the parameters with a few small ops each.

Not every backend's hooks survive compiled autograd: FSDP2's run in its own autograd functions
and post-backward callbacks that compiled autograd's captured graph leaves out, so its
gradients were never reduced (the losses leave the reference's), and FSDP1's assigned a whole
gradient to a flat shard (a size error). Such an engine says so
(``Engine.compiled_autograd = False``) and its backward runs eagerly, forward and optimizer
still compiled. Every engine that compiles counts its first step's time as compile time
(the loop records it apart from the step times).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from kan_models.compile import any_batch_size


class StepCompilation:
    """What an engine compiles under ``training.compile: step``: ``optimizer``'s step, the
    engine's forward-and-loss function (:meth:`region`), and, with ``compiled_autograd``, every
    backward pass (:meth:`backward`). ``mode``: torch.compile's (``reduce-overhead``: CUDA graphs)."""

    def __init__(self, optimizer: torch.optim.Optimizer, compiled_autograd: bool, mode: str = "default") -> None:
        self.options: dict[str, Any] = {} if mode == "default" else {"mode": mode}
        self.optimizer_step = torch.compile(optimizer.step, **self.options)
        self.compiled_autograd = compiled_autograd
        # One compiler for every backward: compiled autograd caches its graphs by the autograd
        # graph's structure, and this step's graph is the same every step.
        self._backward_compiler = torch.compile(dynamic=False, **self.options) if compiled_autograd else None

    def region(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """``fn(x, y, ...)`` compiled for every batch size at once (see :func:`any_batch_size`)."""
        compiled = torch.compile(fn, **self.options)

        def call(x: torch.Tensor, y: torch.Tensor, *rest: Any) -> torch.Tensor:
            return compiled(any_batch_size(x), any_batch_size(y), *rest)

        return call

    def backward(self) -> contextlib.AbstractContextManager:
        if self._backward_compiler is None:
            return contextlib.nullcontext()
        # Compiled autograd has no public switch for one call in torch 2.13 but this context
        # (the config flag applies only to backward passes inside a compiled region).
        from torch._dynamo import compiled_autograd

        return compiled_autograd._enable(self._backward_compiler)

    def describe(self) -> str:
        parts = [
            "torch.compile(forward + loss)",
            "compiled autograd" if self.compiled_autograd else "eager backward",
            "torch.compile(optimizer.step)",
        ]
        return " + ".join(parts) + (f", mode {self.options['mode']}" if self.options else "")
