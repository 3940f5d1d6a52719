"""The one small interface every strategy implements.

A strategy wraps a model and its optimizer into an :class:`Engine`, which owns the step. The
training loop only calls what is defined here, so it never needs to know which backend is
underneath:

    loss_share = engine.forward_backward(rank_micro_batches, task.loss_sum, global_batch_size)
    engine.step()
    ...
    sums = engine.evaluate(test_chunks, task.metric_sums)

The defaults are plain data parallelism: every rank runs the whole model on its own samples.
A backend that splits the model across ranks (tensor parallel, pipeline schedules) overrides
:meth:`Engine.forward_backward` and :meth:`Engine.evaluate` and tells :class:`DistEnv` how
many data-parallel replicas there are; the loop stays as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from analysis.records.schema import CompileInfo, ModelStateBytes, PrecisionInfo
from strategies.sections import TrainingConfig
from strategies.step.compiled_step import StepCompilation
from strategies.step.precision import Amp, dtype_name
from strategies.step.schedule import innermost
from strategies.torch_files import load_plain, load_weights_only

Batch = tuple[torch.Tensor, torch.Tensor]  # inputs and targets of one micro-batch
# A task's loss summed over a batch's samples, or its additive test statistics.
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
MetricFn = Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]


def detached_copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict's tensors, detached and copied (gathered or not, they outlive the call)."""
    return {k: v.detach().clone() for k, v in state.items()}


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


def watch_compute_dtypes(model: nn.Module) -> set[str]:
    """The dtypes the modules holding parameters output in their first forward pass: what the
    model computed in, whichever mechanism cast it (a model's own output may be cast back to
    float32, as Accelerate does). Each hook removes itself after one call, so steps pay nothing."""
    seen: set[str] = set()
    handles: dict[int, RemovableHandle] = {}

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor) and output.is_floating_point():
            seen.add(dtype_name(output.dtype))
        handles.pop(id(module)).remove()

    for module in model.modules():
        if next(module.parameters(recurse=False), None) is not None:
            handles[id(module)] = module.register_forward_hook(hook)
    return seen


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class Engine:
    """Model + optimizer under one strategy. Subclasses override what their backend does
    differently; the defaults are plain single-process PyTorch."""

    # How :meth:`save` writes (see strategies/lifecycle/checkpoint.py and `kanscale export`).
    checkpoint_format = "torch"
    # Which backend this engine drives, in the strategies' vocabulary (an Accelerate run is
    # labelled by the engine Accelerate chose: accelerate_ddp, accelerate_zero2, ...).
    kind = "single"
    # Whether compiled autograd runs this backend's backward correctly (strategies/step/compiled_step.py).
    compiled_autograd = True

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        training: TrainingConfig,
        amp: Amp | None = None,
        cast: str | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.training = training
        # What this engine runs of mixed precision itself (autocast, a gradient scaler), and how a
        # backend that casts its own parameters does it (``cast``, e.g. FSDP's MixedPrecision).
        self.amp = amp or Amp()
        self.precision_mechanism = self.amp.describe(cast)
        self.input_dtype: torch.dtype | None = None  # a backend whose module is in a low dtype wants its inputs so
        self.compute_dtypes = watch_compute_dtypes(model)
        self._dtype_watch_pending = True
        # Model-state bytes are counted once, in the step the loop names (``count_state``), after
        # the gradients exist and before the update frees them.
        self.counted_state: ModelStateBytes | None = None
        # What the run is called when only the running backend knows (Accelerate picks its
        # backend from the launch config); None: the strategy config's label.
        self.label: str | None = None
        # training.compile: step compiles the forward and loss, the backward and the optimizer step.
        self.compilation = (
            StepCompilation(optimizer, self.compiled_autograd, training.compile_mode)
            if training.compile == "step"
            else None
        )
        self._loss_share = self.compilation.region(self.loss_share) if self.compilation else self.loss_share

    def forward_backward(
        self, batches: Sequence[Batch], loss_sum: LossFn, n_global: int, count_state: bool = False
    ) -> torch.Tensor:
        """Accumulate the gradient of the global batch's mean loss over this rank's micro-batches
        (``n_global`` samples in the whole step, over every rank); return this rank's share of
        that loss, detached. Summed over the ranks, the shares are the global mean.
        ``count_state``: this step's model state is the one the run records; a backend that updates
        the parameters inside the backward counts it here, the others in :meth:`step`."""
        if self.training.compile != "none" and self._dtype_watch_pending:
            # The dtype watch's one-shot hooks must fire, and go, before the step is traced:
            # traced, they stay in the compiled graph and slow every step; in a compiled model they
            # break its graph (their handles). One eager forward pass without gradients fires them.
            with torch.no_grad():
                torch.compiler.disable(self.forward)(batches[0][0])
            self._dtype_watch_pending = False
        backward = self.compilation.backward if self.compilation else contextlib.nullcontext
        # A compiled step takes the sample count as a tensor: as a Python int, an epoch's short
        # last batch would change a constant of the graph and compile it again.
        x0 = batches[0][0]
        n = torch.tensor(n_global, dtype=x0.dtype, device=x0.device) if self.compilation else n_global
        total = None
        for i, (x, y) in enumerate(batches):
            with self.gradient_sync(i == len(batches) - 1):
                loss = self._loss_share(x, y, loss_sum, n)
                with backward():
                    self.backward(loss)
            total = loss.detach() if total is None else total + loss.detach()
        assert total is not None, "a step has at least one micro-batch"
        return total

    def loss_share(
        self, x: torch.Tensor, y: torch.Tensor, loss_sum: LossFn, n_global: int | torch.Tensor
    ) -> torch.Tensor:
        """This micro-batch's share of the global batch's mean loss (compiled as one graph under
        ``training.compile: step``)."""
        return loss_sum(self.forward(x), y) / n_global

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The model's output for ``x``, in the experiment's dtype: mixed precision computes in a
        low dtype, but the loss and the metrics are always taken in full precision."""
        with self.amp.context():
            out = self.model(x if self.input_dtype is None else x.to(self.input_dtype))
        return out.to(getattr(torch, self.training.dtype))

    @torch.no_grad()
    def evaluate(self, batches: Iterable[Batch], metric_sums: MetricFn) -> dict[str, torch.Tensor]:
        """This rank's additive test statistics over ``batches``, in evaluation mode. Every rank
        is given the same number of batches: sharded backends gather parameters in each forward."""
        self.model.eval()
        sums: dict[str, torch.Tensor] = {}
        for x, y in batches:
            for name, value in metric_sums(self.forward(x), y).items():
                sums[name] = sums[name] + value if name in sums else value
        self.model.train()
        return sums

    def gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-step; ``enabled`` is False for all but the last micro-step of a
        gradient-accumulation window, so backends can skip synchronizing gradients there."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """``loss`` is this rank's share of the global-batch mean loss: the sum over all ranks
        and micro-steps of these shares is the global mean. Backends that average gradients
        over ranks (or over accumulation steps) rescale it here so the gradient is exactly that
        of the global mean."""
        self.amp.scale(loss).backward()

    def clip_grad_norm(self, max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def step(self, count_state: bool = False) -> None:
        """Clip (if configured), update the parameters, clear the gradients; with ``count_state``,
        count the model state (:attr:`counted_state`) before the update frees the gradients."""
        if self.training.grad_clip > 0:
            self.amp.unscale(self.optimizer)
            self.clip_grad_norm(self.training.grad_clip)
        if count_state:
            self.counted_state = self.model_state_bytes()
        if self.compilation is not None:
            self.compilation.optimizer_step()  # fp16's scaler is refused with it (TrainingConfig)
        else:
            self.amp.step(self.optimizer)
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

    def precision_info(self) -> PrecisionInfo:
        """What ran, read from the objects that ran it: the module's parameters, the tensors the
        optimizer updates (a wrapper's inner optimizer: DeepSpeed's fp32 masters), and what the
        modules returned in the first forward pass (:func:`watch_compute_dtypes`)."""
        updated = self.updated_tensors()
        return PrecisionInfo(
            setting=self.training.precision,
            mechanism=self.precision_mechanism,
            param_dtype=dtype_name(next(self.model.parameters()).dtype),
            optimizer_dtype=dtype_name(updated[0].dtype) if updated else None,
            compute_dtype="+".join(sorted(self.compute_dtypes)) or None,
        )

    def compile_info(self) -> CompileInfo:
        """What ``training.compile`` compiled, and how."""
        setting = self.training.compile
        mechanism = {"none": "eager", "model": "torch.compile(model)"}.get(setting)
        if self.compilation is not None:
            mechanism = self.compilation.describe()
        return CompileInfo(setting=setting, mechanism=mechanism, mode=self.training.compile_mode)

    def updated_tensors(self) -> list[torch.Tensor]:
        """The tensors the optimizer updates (inside Accelerate's and DeepSpeed's wrappers)."""
        return [p for group in innermost(self.optimizer).param_groups for p in group["params"]]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state as a plain state dict with the unwrapped model's keys, on
        every rank. Sharded engines gather it, so every rank must call this together."""
        return detached_copy(self.model.state_dict())

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Replace the model's state with ``state`` (as :meth:`full_state_dict` returns it),
        re-sharding where the engine shards. Every rank calls this with the same state."""
        self.model.load_state_dict(state)

    def save(self, directory: Path) -> None:
        """Write the model and optimizer state into ``directory`` (every rank calls this). The
        default: rank 0 writes one ``torch.save`` file; every rank holds the same state."""
        if is_rank0():
            torch.save(
                {"model": self.full_state_dict(), "optimizer": self.optimizer.state_dict()}, directory / "state.pt"
            )

    @staticmethod
    def consolidate(directory: Path) -> dict[str, torch.Tensor]:
        """The whole model's state dict from a checkpoint this class wrote, in one process
        without a process group (``kanscale export``)."""
        return load_weights_only(directory / "state.pt", "cpu")["model"]  # export names what it refuses

    def load(self, directory: Path) -> None:
        state = load_plain(directory / "state.pt", next(self.model.parameters()).device, "checkpoint file")
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

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        training: TrainingConfig,
        world_size: int,
        amp: Amp | None = None,
        cast: str | None = None,
    ) -> None:
        super().__init__(model, optimizer, training, amp, cast)
        self.world_size = world_size

    def backward(self, loss: torch.Tensor) -> None:
        # the world size as the loss's gradient, not a product: one autograd node fewer a step
        scale = torch.full((), float(self.world_size), dtype=loss.dtype, device=loss.device)
        self.amp.scale(loss).backward(scale)
