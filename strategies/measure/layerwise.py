"""A compute baseline that never holds more than a sharding strategy's own share of the model.

The replica baseline (strategies/measure/baseline.py) keeps a whole copy of the model and its
optimizer on every rank; under FSDP or ZeRO-3 that is several times the rank's sharded state, so a
model that fits only sharded could not be measured at all. This one times the same per-rank work
the way a sharding backend does it, one unit at a time:

- forward and backward of each unit the strategy shards (its ``wrap_units``), over the inputs that
  unit saw on this rank's micro-batches, with a unit built for the sample and freed after it (as
  FSDP gathers one unit at a time);
- the optimizer step over this rank's shard of the parameters, with the experiment's optimizer:
  what a sharded optimizer updates. It steps a flat chunk of at most CHUNK elements as many times
  as the shard holds chunks, so the arithmetic is the shard's but the memory one chunk's (a
  parameter, its gradient and the optimizer's state tensors for it).

What it keeps between samples is the units' inputs (one activation per unit per micro-batch), the
units' buffers (spline grids) and that chunk: a small part of the strategy's own share. The
units' weights are not kept: each sample fills them with values of the trained model's mean and
spread per tensor (the arithmetic, so the time, does not depend on the values; a learning rate of
0 keeps the replica's the same way). Not timed: work outside the units (the loss, a model's own
glue between them), which so counts as overhead, and compilation (the units run eagerly;
preflight refuses ``layerwise`` with ``training.compile``).
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Sequence

import torch
from torch import nn

from kanscale.errors import ConfigError
from strategies.sections import TrainingConfig
from strategies.step.engine import Batch, LossFn
from strategies.step.optim import build_optimizer
from strategies.step.precision import Amp, low_dtype

# Elements of the optimizer chunk: 16 MiB per fp32 tensor, larger than a CPU's caches (so each
# step streams from memory as the shard's does), small beside any model worth sharding.
CHUNK = 4 * 2**20


class LayerwiseBaseline:
    """Built from the whole model before the strategy shards it (every rank holds it then anyway),
    ``units`` its sharded units, ``shard_degree`` the ranks one copy of the state is split over."""

    def __init__(
        self,
        model: nn.Module,
        units: Sequence[nn.Module],
        device: torch.device,
        training: TrainingConfig,
        shard_degree: int,
        steps: int,
    ) -> None:
        if not units:
            raise ConfigError(
                "measurement.baseline: layerwise needs the units the strategy shards, and this model has "
                "none (model.wrap); set measurement.baseline=replica or off"
            )
        self.device, self.steps = device, steps
        # The training's model and units, until warm_up() has captured the units' inputs with them.
        self.model: nn.Module | None = model
        self.units: list[nn.Module] | None = list(units)
        self.amp = Amp(device.type, low_dtype(training))
        # The units as skeletons: parameters on the meta device (no memory), buffers kept.
        self.skeletons = [
            copy.deepcopy(
                unit,
                {id(p): nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad) for p in unit.parameters()},
            )
            for unit in units
        ]
        self.fills = [
            [
                (p.detach().float().mean().item(), p.detach().float().std().item() if p.numel() > 1 else 0.0)
                for p in unit.parameters()
            ]
            for unit in units
        ]
        shard = math.ceil(sum(p.numel() for p in model.parameters() if p.requires_grad) / shard_degree)
        self.chunks = math.ceil(shard / CHUNK)
        chunk = nn.Parameter(
            torch.zeros(math.ceil(shard / self.chunks), device=device, dtype=next(model.parameters()).dtype)
        )
        chunk.grad = torch.full_like(chunk, 1e-3)
        still = training.model_copy(update={"lr": 0.0})  # as the replica's: every sample does the same arithmetic
        self.optimizer = build_optimizer([chunk], still)
        self.inputs: list[list[torch.Tensor]] = []
        self.samples: list[float] = []

    def _held(self) -> int:
        """Bytes of the tensors kept between samples, counted from them (as the replica's are): a
        difference of resident memory across the warm-up also counted what its steps had freed
        and the allocator kept, which the training's own step reuses, and read peaks low."""
        chunk = self.optimizer.param_groups[0]["params"][0]
        kept = [*(x for xs in self.inputs for x in xs), *(b for s in self.skeletons for b in s.buffers())]
        kept += [chunk, chunk.grad, *(v for v in self.optimizer.state[chunk].values() if isinstance(v, torch.Tensor))]
        return sum(t.numel() * t.element_size() for t in kept if t is not None)

    def _capture(self, model: nn.Module, units: list[nn.Module], batches: Sequence[Batch]) -> None:
        """Each unit's input on each micro-batch, from one pass of the whole model (no gradients)."""
        seen: list[list[torch.Tensor]] = [[] for _ in units]

        def keeper(i: int):
            def hook(_module: nn.Module, args: tuple) -> None:
                if len(args) != 1 or not isinstance(args[0], torch.Tensor):
                    raise ConfigError(
                        f"measurement.baseline: layerwise times units that take one tensor, and unit {i} "
                        f"({type(units[i]).__name__}) takes {len(args)} argument(s); set "
                        "measurement.baseline=replica or off"
                    )
                seen[i].append(args[0].detach().clone())

            return hook

        handles = [unit.register_forward_pre_hook(keeper(i)) for i, unit in enumerate(units)]
        try:
            with torch.no_grad(), self.amp.context():
                for x, _ in batches:
                    model(x)
        finally:
            for handle in handles:
                handle.remove()
        self.inputs = seen

    def _build(self, i: int) -> nn.Module:
        """Unit ``i`` with real storage: its buffers as saved, its weights filled (see above)."""
        unit = copy.deepcopy(self.skeletons[i]).to_empty(device=self.device)
        with torch.no_grad():
            for (_, mine), (_, saved) in zip(unit.named_buffers(), self.skeletons[i].named_buffers(), strict=True):
                mine.copy_(saved)
            for p, (mean, std) in zip(unit.parameters(), self.fills[i], strict=True):
                p.normal_(mean, std)
        return unit

    def _step(self) -> float:
        """One step's compute: every unit's forward and backward, then the optimizer shard's step."""
        total = 0.0
        for i in range(len(self.skeletons)):
            unit = self._build(i)
            self._sync()
            start = time.perf_counter()
            for x in self.inputs[i]:
                x = x.requires_grad_(i > 0)  # the first unit's input is data: no gradient, as in training
                with self.amp.context():
                    out = unit(x)
                # A unit may return several tensors (pykan's layer: its output and what it saw on
                # the way); each that carries a gradient gets one, as the loss would give it.
                outs = [
                    t
                    for t in (out if isinstance(out, (tuple, list)) else [out])
                    if isinstance(t, torch.Tensor) and t.requires_grad
                ]
                torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
                x.grad = None
            self._sync()
            total += time.perf_counter() - start
            del unit
        start = time.perf_counter()
        for _ in range(self.chunks):
            self.optimizer.step()
        self._sync()
        return total + time.perf_counter() - start

    def warm_up(self, batches: Sequence[Batch], n_global: int, loss_sum: LossFn, steps: int) -> None:
        """Capture the units' inputs, take untimed steps (the optimizer's state comes to exist),
        then measure what the baseline holds."""
        if self.model is None or self.units is None:
            raise RuntimeError("the layerwise baseline is warmed up once: the training's model is not kept after")
        self._capture(self.model, self.units, batches)
        # The whole model and its units are the training's, which the strategy is about to shard.
        self.model = self.units = None
        for _ in range(max(1, steps)):
            self._step()
        self.held_bytes = self._held()

    def sample(self, batches: Sequence[Batch], n_global: int, loss_sum: LossFn) -> float:
        """The median of ``steps`` timed steps (on the units' inputs captured at warm-up: the
        window's batches have the same shapes)."""
        self.samples.append(statistics.median(self._step() for _ in range(self.steps)))
        return self.samples[-1]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
