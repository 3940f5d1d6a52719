"""``tp`` and ``fsdp2_tp``: tensor parallelism over the KAN layers (strategies/backends/tp_plan.py).

``tp`` cuts every layer over all ranks: one model replica, every rank trains on the same samples.
``fsdp2_tp`` is the 2-D form: a (dp, tp) device mesh, the layers cut over its ``tp`` dimension
and FSDP2 sharding (and averaging gradients) over its ``dp`` one, dp x tp = world size. Data
sharding, the loss and the step records use the data-parallel position (DistEnv.split_into_replicas).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from kan_models.base import ModelConfig
from kanscale.errors import ConfigError
from analysis.projection.step_model import StrategyModel
from strategies.backends.dcp import DTensorStateDicts, ShardedCheckpoints
from strategies.backends.fsdp2 import FSDP2Config, FSDP2Engine
from strategies.backends.tp_plan import PLANS, LayerPlan, apply_tp, layer_plans, local_share, reduce_partial_gradients
from strategies.distributed import DistEnv
from strategies.engine import Engine
from strategies.optim import build_optimizer
from strategies.precision import Amp
from strategies.sections import TrainingConfig
from strategies.strategy import StrategyConfig

PlanName = Literal["pairs", "colwise", "rowwise"]
PLAN_HELP = "how layers are cut: " + "; ".join(f"{name}: {text}" for name, text in PLANS.items())


def layout(plans: list[LayerPlan], dp: int, tp: int) -> dict:
    """What the record's backend_config says of the cut: the mesh and each layer's split."""
    return {"mesh": {"dp": dp, "tp": tp}, "layers": [p.split for p in plans]}


def check_model_splits(model: ModelConfig, tp: int, plan: str) -> None:
    """Refuse, before launch, a model tensor parallelism cannot cut at degree ``tp``."""
    sketch = model.sketch()
    layers = getattr(sketch, "blocks", None)
    if not layers or not all(hasattr(layer, "layer_split") for layer in layers):
        raise ConfigError(f"model.family: tensor parallelism cuts layers that declare how (bspline, rbf, chebyshev); "
                          f"{model.family}'s do not; use one of those families, or a data-parallel strategy (fsdp2)")
    if all(p.split == "whole" for p in layer_plans(layers, tp, plan)):
        raise ConfigError(f"model.widths: TP degree {tp} divides no layer's width in {model.widths}, so no layer would "
                          f"be cut; use widths divisible by {tp}, or another strategy")


def check_precision(training: TrainingConfig, label: str) -> None:
    if training.precision == "fp16":
        raise ConfigError(f"training.precision: fp16's gradient scaler is not run under {label} (its gradients are "
                          "DTensors); use precision bf16 or fp32")


class TPEngine(DTensorStateDicts, ShardedCheckpoints, Engine):
    """Every rank holds its shards of every cut layer; gradients need no averaging (one replica)."""

    kind = "tp"
    compiled_autograd = False

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, training: TrainingConfig, amp: Amp,
                 cut: dict) -> None:
        super().__init__(model, optimizer, training, amp)
        self.cut = cut

    def step(self) -> None:
        reduce_partial_gradients(self.model)
        super().step()

    def backend_config(self) -> dict:
        return self.cut


class TPConfig(StrategyConfig):
    """Tensor parallelism: every KAN layer cut over all ranks (DTensor, local_map)."""

    name: Literal["tp"]
    plan: PlanName = Field("pairs", description=PLAN_HELP)

    compiles_model: ClassVar[bool] = False

    def ranks_per_replica(self, world_size: int) -> int:
        return world_size

    def cost_model(self) -> StrategyModel | None:
        # each layer's tensors cut over every rank, activations exchanged per layer as the pairs
        # plan exchanges them (tp_exchanges); the other plans are not modelled yet
        return StrategyModel(self.label(), grads="none", tp=0) if self.plan == "pairs" else None

    def preflight(self, training: TrainingConfig, device_type: str, world_size: int) -> None:
        check_precision(training, self.label())
        check_model_splits(self.resolved_model(), world_size, self.plan)

    def apply(self, model: nn.Module, training: TrainingConfig, env: DistEnv) -> Engine:
        mesh = init_device_mesh(env.device.type, (env.world_size,), mesh_dim_names=("tp",))
        plans = apply_tp(model, mesh, self.plan)
        return TPEngine(model, build_optimizer(model.parameters(), training), training,
                        Amp.autocast(training, env.device.type), layout(plans, 1, env.world_size))

    def compute_replica(self, model: nn.Module, env: DistEnv) -> nn.Module:
        return local_share(model, layer_plans(model.blocks, env.world_size, self.plan), env.rank, env.world_size)


class FSDP2TPEngine(FSDP2Engine):
    kind = "fsdp2_tp"

    def __init__(self, *args: Any, cut: dict) -> None:
        super().__init__(*args)
        self.cut = cut

    def backend_config(self) -> dict:
        return self.cut


class FSDP2TPConfig(FSDP2Config):
    """2-D: FSDP2 over the data-parallel mesh dimension, tensor parallelism over the other."""

    name: Literal["fsdp2_tp"]  # type: ignore[assignment]
    tp_degree: int = Field(2, ge=1, description="ranks each layer is cut over; the data-parallel degree is world "
                                                "size / tp_degree")
    plan: PlanName = Field("pairs", description=PLAN_HELP)
    shard_largest_dim: bool = Field(False, description="FSDP2 shards the TP shards along dim 0 (FSDP2 composes with "
                                                       "TP on dim 0 only)")

    compiles_step: ClassVar[bool] = False
    compiles_model: ClassVar[bool] = False

    def label(self) -> str:
        return super().label() + "_tp"

    def cost_model(self) -> StrategyModel | None:
        # the layers cut over tp_degree ranks (pairs plan), FSDP2 over the data-parallel ones
        if self.plan != "pairs" or not self.reshard_after_forward:
            return None
        return StrategyModel(self.label(), grads="reduce_scatter", gather="per_unit", sharded_state=True,
                             sharded_params="trainable", tp=self.tp_degree)

    def ranks_per_replica(self, world_size: int) -> int:
        return self.tp_degree

    def preflight(self, training: TrainingConfig, device_type: str, world_size: int) -> None:
        super().preflight(training, device_type, world_size)
        if world_size % self.tp_degree:
            raise ConfigError(f"strategy.tp_degree: {self.tp_degree} does not divide the world size {world_size} "
                              f"(dp x tp = world size); launch a multiple of {self.tp_degree} ranks or change tp_degree")
        if self.shard_largest_dim:
            raise ConfigError("strategy.shard_largest_dim: FSDP2 shards tensor-parallel parameters along dim 0 only; "
                              "set strategy.shard_largest_dim=false")
        check_precision(training, self.label())
        check_model_splits(self.resolved_model(), self.tp_degree, self.plan)

    def apply(self, model: nn.Module, training: TrainingConfig, env: DistEnv) -> Engine:
        tp = self.tp_degree
        mesh = init_device_mesh(env.device.type, (env.world_size // tp, tp), mesh_dim_names=("dp", "tp"))
        plans = apply_tp(model, mesh["tp"], self.plan)
        return self.shard(model, training, mesh["dp"], env, FSDP2TPEngine, cut=layout(plans, env.world_size // tp, tp))

    def compute_replica(self, model: nn.Module, env: DistEnv) -> nn.Module:
        tp = self.tp_degree
        return local_share(model, layer_plans(model.blocks, tp, self.plan), env.rank % tp, tp)
