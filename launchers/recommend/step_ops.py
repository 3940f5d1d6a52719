"""The operations of one training step of an experiment's model, counted here in one process for
the device-time model (analysis/projection/device_time.py): the kernels of the forward, the
backward and the optimizer step as strategies/measure/kernels.py records them."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from typing import TypeVar

import torch

from analysis.projection.device_time import StepOps
from kan_models import build_model
from kan_models.base import ModelConfig
from kan_models.wrap import wrap_units
from strategies.loop.activation_checkpointing import apply_activation_checkpointing
from strategies.measure.kernels import KernelRecorder
from strategies.sections import TrainingConfig

T = TypeVar("T")


def count_step_ops(model: ModelConfig, training: TrainingConfig, micro_batch: int, seed: int = 0) -> StepOps:
    """The ops of one training step (forward, MSE loss, backward, the experiment's optimizer as a
    GPU runs it: ``foreach``) at ``micro_batch`` samples, counted :func:`on_shapes_where_possible`;
    with ``training.activation_checkpointing``, the backward runs the recomputed forwards too."""
    return on_shapes_where_possible(model, lambda: _count(model, training, micro_batch, seed))


def on_shapes_where_possible(model: ModelConfig, work: Callable[[], T]) -> T:
    """``work``, which builds ``model`` and runs it, on fake tensors (shapes, no storage: a model of
    any size in seconds and no memory) where the family can be built without computing, else on
    real ones (pykan fits its splines while it builds), and on real ones where a step reads a
    tensor's values (a data-dependent op, which fake tensors cannot run)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    from launchers.zoo import meta_sketch

    if meta_sketch(model) is not None:
        try:
            with FakeTensorMode(allow_non_fake_inputs=True):
                return work()
        except DataDependentOutputException:
            pass
    return work()


def _count(model: ModelConfig, training: TrainingConfig, micro_batch: int, seed: int) -> StepOps:
    from strategies.step.optim import build_optimizer, launch_as_on_gpu

    with contextlib.redirect_stdout(io.StringIO()):  # pykan prints its checkpoints
        net = build_model(model, seed)
    if training.activation_checkpointing == "layers":
        apply_activation_checkpointing(wrap_units(net, model.wrap), training.activation_checkpointing_every)
    params = [p for p in net.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, training)
    launch_as_on_gpu(optimizer)
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(micro_batch, model.widths[0], generator=generator)
    y = torch.rand(micro_batch, model.widths[-1], generator=generator)
    recorder = KernelRecorder()
    with recorder.phase_of_step("forward"):
        loss = torch.nn.functional.mse_loss(net(x), y)
    with recorder.phase_of_step("backward"):
        loss.backward()
    with recorder.phase_of_step("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return StepOps(model.describe(), micro_batch, tuple(recorder.ops))
