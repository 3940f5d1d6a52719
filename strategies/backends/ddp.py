"""``ddp``: PyTorch DistributedDataParallel. Every rank holds the whole model; gradients are
all-reduced in buckets during the backward pass, overlapping with it."""

from __future__ import annotations

import contextlib
from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from analysis.projection.strategy_model import StrategyModel
from strategies.runtime.distributed import DistEnv
from strategies.sections import TrainingConfig
from strategies.step.engine import AveragingEngine, Engine, detached_copy
from strategies.step.optim import build_optimizer
from strategies.step.precision import Amp
from strategies.strategy import StrategyConfig


class DDPEngine(AveragingEngine):
    kind = "ddp"
    model: DistributedDataParallel

    def gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if enabled else self.model.no_sync()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return detached_copy(self.model.module.state_dict())

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.model.module.load_state_dict(state)


class DDPConfig(StrategyConfig):
    """DistributedDataParallel: full replica per rank, bucketed gradient all-reduce."""

    name: Literal["ddp"]
    probes: ClassVar[frozenset[str]] = frozenset({"paper"})  # the published study instrumented DDP
    compiles_step: ClassVar[bool] = True
    bucket_cap_mb: float = Field(25.0, gt=0.0, description="gradient bucket size in MiB")
    static_graph: bool = Field(False, description="tell DDP the graph does not change between steps")
    gradient_as_bucket_view: bool = Field(False, description="gradients are views into the buckets (saves a copy)")

    def cost_model(self) -> StrategyModel:
        # its buckets all-reduced as backward fills them (ddp_buckets)
        return StrategyModel(self.label(), grads="ddp_buckets", bucket_bytes=self.bucket_cap_mb * 2**20)

    def apply(self, model: nn.Module, training: TrainingConfig, env: DistEnv) -> Engine:
        if training.compile == "step":
            # Compiled autograd captures DDP's gradient all-reduce only as its Python reducer.
            torch._dynamo.config.optimize_ddp = "python_reducer"
        ddp = DistributedDataParallel(
            model,
            device_ids=[env.device.index] if env.device.type == "cuda" else None,
            bucket_cap_mb=self.bucket_cap_mb,
            static_graph=self.static_graph,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
        )
        return DDPEngine(
            ddp,
            build_optimizer(ddp.parameters(), training),
            training,
            env.world_size,
            Amp.autocast(training, env.device.type),
        )
