"""``tp`` and ``fsdp2_tp``: tensor parallelism over the KAN layers (strategies/backends/tp_plan.py).

``tp`` cuts every layer over all ranks: one model replica, every rank trains on the same samples.
``fsdp2_tp`` is the 2-D form, torchtitan's composition: the layers cut over the run mesh's ``tp``
dimension, then FSDP2 (strategies/backends/fsdp2.py, ``apply_fsdp2``) sharding and averaging
gradients over its ``dp_shard`` one, dp x tp = world size. Data sharding, the loss and the step
records use the data-parallel position on the mesh (strategies/runtime/mesh.py).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field
from torch import nn

from analysis.projection.strategy_model import StrategyModel
from kan_models.base import ModelConfig
from kanscale.errors import ConfigError
from strategies.backends.dcp import DTensorStateDicts, ShardedCheckpoints
from strategies.backends.fsdp2 import FSDP2Engine, FSDP2Options, apply_fsdp2
from strategies.backends.tp_plan import (
    PLANS,
    LayerPlan,
    apply_tp,
    blocks_of,
    layer_plans,
    local_share,
    reduce_partial_gradients,
)
from strategies.runtime.distributed import DistEnv
from strategies.runtime.mesh import MeshShape, RunMesh
from strategies.sections import Section, TrainingConfig
from strategies.step.engine import Engine
from strategies.step.optim import build_optimizer
from strategies.step.precision import Amp
from strategies.strategy import StrategyConfig

PlanName = Literal["pairs", "colwise", "rowwise"]
PLAN_HELP = "how layers are cut: " + "; ".join(f"{name}: {text}" for name, text in PLANS.items())


def layout(plans: list[LayerPlan], mesh: RunMesh) -> dict:
    """What the record's backend_config says of the cut: the mesh and each layer's split."""
    return {"mesh": {"dp": mesh.dp_size, "tp": mesh.tp_size}, "layers": [p.split for p in plans]}


def check_model_splits(model: ModelConfig, tp: int, plan: str) -> None:
    """Refuse, before launch, a model tensor parallelism cannot cut at degree ``tp``."""
    sketch = model.sketch()
    layers = getattr(sketch, "blocks", None)
    if not layers or not all(hasattr(layer, "layer_split") for layer in layers):
        raise ConfigError(
            f"model.family: tensor parallelism cuts layers that declare how (bspline, rbf, chebyshev); "
            f"{model.family}'s do not; use one of those families, or a data-parallel strategy (fsdp2)"
        )
    if all(p.split == "whole" for p in layer_plans(layers, tp, plan)):
        raise ConfigError(
            f"model.widths: TP degree {tp} divides no layer's width in {model.widths}, so no layer would "
            f"be cut; use widths divisible by {tp}, or another strategy"
        )


def check_precision(training: TrainingConfig, label: str) -> None:
    if training.precision == "fp16":
        raise ConfigError(
            f"training.precision: fp16's gradient scaler is not run under {label} (its gradients are "
            "DTensors); use precision bf16 or fp32"
        )


class CutLayout:
    """An engine that reports how tensor parallelism cut the model (:func:`layout`) as its backend config."""

    def __init__(self, *args: Any, cut: dict, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cut = cut

    def backend_config(self) -> dict:
        return self.cut


class TPEngine(CutLayout, DTensorStateDicts, ShardedCheckpoints, Engine):
    """Every rank holds its shards of every cut layer; gradients need no averaging (one replica)."""

    kind = "tp"
    compiled_autograd = False

    def step(self, count_state: bool = False) -> None:
        reduce_partial_gradients(self.model)
        super().step(count_state)


class FSDP2TPEngine(CutLayout, FSDP2Engine):
    kind = "fsdp2_tp"


class TPOptions(Section):
    """How the layers are cut: the options of ``tp`` and of the TP half of ``fsdp2_tp``."""

    plan: PlanName = Field("pairs", description=PLAN_HELP)

    def tp_share(self, model: nn.Module, mesh: RunMesh) -> nn.Module:
        """This rank's part of a plain copy of ``model``, cut as the plan cuts it over the mesh's ``tp``."""
        return local_share(model, layer_plans(blocks_of(model), mesh.tp_size, self.plan), mesh.tp_rank, mesh.tp_size)


class TPConfig(TPOptions, StrategyConfig):
    """Tensor parallelism: every KAN layer cut over all ranks (DTensor, local_map)."""

    name: Literal["tp"]

    compiles_model: ClassVar[bool] = False

    def mesh_shape(self, world_size: int, ranks_per_node: int | None = None) -> MeshShape:
        return MeshShape(tp=world_size)

    def cost_model(self) -> StrategyModel | None:
        # each layer's tensors cut over every rank, activations exchanged per layer as the pairs
        # plan exchanges them (tp_exchanges); the other plans are not modelled yet
        return StrategyModel(self.label(), grads="none", tp=0) if self.plan == "pairs" else None

    def preflight(self, training: TrainingConfig, device_type: str, world_size: int) -> None:
        check_precision(training, self.label())
        check_model_splits(self.resolved_model(), world_size, self.plan)

    def apply(self, model: nn.Module, training: TrainingConfig, env: DistEnv) -> Engine:
        plans = apply_tp(model, env.mesh["tp"], self.plan)
        return TPEngine(
            model,
            build_optimizer(model.parameters(), training),
            training,
            Amp.autocast(training, env.device.type),
            cut=layout(plans, env.mesh),
        )

    def compute_replica(self, model: nn.Module, env: DistEnv) -> nn.Module:
        return self.tp_share(model, env.mesh)


class FSDP2TPConfig(FSDP2Options, TPOptions, StrategyConfig):
    """2-D: tensor parallelism over the mesh's ``tp`` dimension, then FSDP2 over its ``dp_shard`` one."""

    name: Literal["fsdp2_tp"]
    tp_degree: int = Field(
        2, ge=1, description="ranks each layer is cut over; the data-parallel degree is world size / tp_degree"
    )
    shard_largest_dim: bool = Field(
        False, description="FSDP2 shards the TP shards along dim 0 (FSDP2 composes with TP on dim 0 only)"
    )

    compiles_model: ClassVar[bool] = False

    def label(self) -> str:
        return self.fsdp2_label() + "_tp"

    def mesh_shape(self, world_size: int, ranks_per_node: int | None = None) -> MeshShape:
        return MeshShape.with_tp(world_size, self.tp_degree, "strategy.tp_degree")

    def cost_model(self) -> StrategyModel | None:
        # the layers cut over tp_degree ranks (pairs plan), FSDP2 over the data-parallel ones
        if self.plan != "pairs" or not self.reshard_after_forward:
            return None
        return StrategyModel(
            self.label(),
            grads="reduce_scatter",
            gather="per_unit",
            sharded_state=True,
            sharded_params="trainable",
            tp=self.tp_degree,
        )

    def preflight(self, training: TrainingConfig, device_type: str, world_size: int) -> None:
        self.check_fsdp2(training, device_type)
        self.mesh_shape(world_size)
        if self.shard_largest_dim:
            raise ConfigError(
                "strategy.shard_largest_dim: FSDP2 shards tensor-parallel parameters along dim 0 only; "
                "set strategy.shard_largest_dim=false"
            )
        check_precision(training, self.label())
        check_model_splits(self.resolved_model(), self.tp_degree, self.plan)

    def apply(self, model: nn.Module, training: TrainingConfig, env: DistEnv) -> Engine:
        plans = apply_tp(model, env.mesh["tp"], self.plan)
        cast = apply_fsdp2(model, self.wrap_units(model), env.mesh["dp_shard"], self, training)
        return FSDP2TPEngine(
            model,
            build_optimizer(model.parameters(), training),
            training,
            env.mesh.dp_size,
            Amp.sharded_scaler(training, env.device.type),
            cast,
            cut=layout(plans, env.mesh),
        )

    def compute_replica(self, model: nn.Module, env: DistEnv) -> nn.Module:
        return self.tp_share(model, env.mesh)
