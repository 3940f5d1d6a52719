"""Opt-in torch.compile for every zoo model (``training.compile: model``), its compile time
measured apart from the step times."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn


def any_batch_size(batch: torch.Tensor) -> torch.Tensor:
    """``batch`` with its first dimension marked dynamic, so a compiled graph serves every batch
    size: an epoch's short last batch would otherwise compile again inside a timed window (and once
    more, dynamically, at the next full batch), and a dynamic graph is no slower on the study's
    model (docs/models.md)."""
    torch._dynamo.maybe_mark_dynamic(batch, 0)
    return batch


def graph_break_counts() -> dict[str, int]:
    """How often torch.compile broke a graph in this process so far, by reason (dynamo's own counter)."""
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


def graph_breaks(before: dict[str, int]) -> list[str]:
    """The distinct reasons torch.compile broke a graph since ``before`` (graph_break_counts()),
    each cut to its first line: empty where every region compiled since became one graph. Breaks
    asked for by name (``torch._dynamo.graph_break()``, which PyTorch's own optimizer step calls)
    are meant, not a model's surprise, and are left out."""
    reasons = {
        reason.strip().splitlines()[0] for reason, n in graph_break_counts().items() if n > before.get(reason, 0)
    }
    return sorted(r for r in reasons if "torch._dynamo.graph_break()" not in r)


def compile_model(model: nn.Module, sample: torch.Tensor, **options: Any) -> tuple[nn.Module, float]:
    """Compile ``model`` in place and return it with the compile time in seconds.

    ``nn.Module.compile`` keeps the same module object, parameters and state-dict keys (no
    ``_orig_mod.`` prefix), so optimizers, checkpoints and sharding wrappers see the model as
    before. torch.compile compiles lazily, at the first call; this helper makes that call now:
    one forward and backward on ``sample``, a batch of the dtype and device training will use (its
    batch dimension compiled dynamic, so other batch sizes reuse the graph). The backward goes
    through ``torch.autograd.grad``, so no parameter's ``.grad`` is touched. ``options`` go to
    torch.compile (e.g. ``mode``)."""
    model.compile(**options)
    any_batch_size(sample)
    if sample.device.type == "cuda":
        torch.cuda.synchronize(sample.device)
    start = time.perf_counter()
    out = model(sample)
    params = [p for p in model.parameters() if p.requires_grad]
    if params and out.requires_grad:
        torch.autograd.grad(out.sum(), params, allow_unused=True)
    if sample.device.type == "cuda":
        torch.cuda.synchronize(sample.device)
    return model, time.perf_counter() - start
