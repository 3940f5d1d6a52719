"""``fsdp2``: PyTorch's per-parameter FSDP (``fully_shard``), applied to every unit of the model
(by default each KAN layer; kan_models/wrap.py) and to the root. Parameters become DTensors
sharded over the run mesh's ``dp_shard`` dimension: all ranks, or with ``shard_degree`` (the
``hsdp`` preset) the ranks of one node, replicated across nodes over ``dp_replicate`` (HSDP: the
gathers and reduce-scatters stay inside a node, and only the shards' all-reduce crosses nodes).
``apply_fsdp2`` is the same over any data-parallel sub-mesh, which ``fsdp2_tp`` applies after tensor
parallelism."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard

from analysis.projection.strategy_model import StrategyModel
from kanscale.errors import ConfigError
from strategies.backends.dcp import DTensorStateDicts, ShardedCheckpoints
from strategies.runtime.distributed import DistEnv
from strategies.runtime.mesh import MeshShape
from strategies.sections import Section, TrainingConfig
from strategies.step.engine import AveragingEngine, Engine, frozen_parameters
from strategies.step.optim import build_optimizer
from strategies.step.precision import Amp, dtype_name, low_dtype
from strategies.strategy import StrategyConfig

# looked up with an option that None leaves unset
DTYPES: dict[str | None, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def shard_largest_dim(param: nn.Parameter, world_size: int) -> Shard:
    """Shard each parameter along its longest dimension. FSDP2's default, dim 0, puts a KAN
    output layer's whole coefficient tensor (out = 1, in, G + k) on one rank. FSDP2 shards
    unevenly along dim 0 only, so another dimension is chosen only where the ranks divide it
    (an MLP's [1, 293] output weight stays on dim 0)."""
    dims = [d for d in range(param.dim()) if d == 0 or param.shape[d] % world_size == 0]
    return Shard(max(dims, key=lambda d: param.shape[d])) if param.dim() else Shard(0)


class FSDP2Engine(DTensorStateDicts, ShardedCheckpoints, AveragingEngine):
    # FSDP2's reduce-scatter runs from hooks compiled autograd's captured backward leaves out: under
    # it the gradients were never reduced (strategies/step/compiled_step.py).
    compiled_autograd = False
    kind = "fsdp2"

    @contextlib.contextmanager
    def gradient_sync(self, enabled: bool) -> Iterator[None]:
        assert isinstance(self.model, FSDPModule)  # fully_shard made the root one
        self.model.set_requires_gradient_sync(enabled)
        yield


class FSDP2Options(Section):
    """What fully_shard is given, whichever mesh it shards over: the options of ``fsdp2`` and of
    the FSDP2 half of ``fsdp2_tp`` (strategies/backends/tp.py)."""

    reshard_after_forward: bool = Field(
        True,
        description="free gathered parameters after forward (ZeRO-3-like); false keeps them until backward "
        "(ZeRO-2-like)",
    )
    cpu_offload: bool = Field(
        False, description="CPUOffloadPolicy: sharded parameters, gradients and optimizer step on the CPU (GPU runs)"
    )
    param_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None,
        description="dtype of gathered parameters for compute; null = what training.precision says (set "
        "training.precision, which every backend follows)",
    )
    reduce_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="dtype of the gradient reduce-scatter; null = float32 (bfloat16 halves the bytes sent)"
    )
    shard_largest_dim: bool = Field(
        True, description="shard each parameter along its longest dimension instead of dim 0"
    )

    def fsdp2_label(self, name: str = "fsdp2") -> str:
        return name if self.reshard_after_forward else f"{name}_keep"

    def check_fsdp2(self, training: TrainingConfig, device_type: str) -> None:
        """Refuse, before launch, options fully_shard cannot run as asked."""
        asked = DTYPES.get(self.param_dtype)
        if asked is not None and asked != (low_dtype(training) or getattr(torch, training.dtype)):
            raise ConfigError(
                f"strategy.param_dtype: {self.param_dtype} contradicts training.precision="
                f"{training.precision}; set training.precision (fp32, bf16 or fp16), which every backend "
                "follows, and leave strategy.param_dtype null"
            )
        if self.cpu_offload and device_type != "cuda":
            raise ConfigError(
                "strategy.cpu_offload: CPUOffloadPolicy moves shards between GPU and CPU and needs CUDA "
                "devices; set strategy.cpu_offload=false on a CPU-only machine"
            )


def apply_fsdp2(
    model: nn.Module, units: list[nn.Module], mesh: DeviceMesh, options: FSDP2Options, training: TrainingConfig
) -> str | None:
    """fully_shard every unit and the root over ``mesh`` (a sub-mesh of the run's), which its
    gradients are averaged over: 1-D, sharded over all of it; 2-D (replicate, shard), HSDP. Returns
    how the parameters are cast for compute, in words (None: they are not)."""
    low = low_dtype(training)
    reduce = DTYPES.get(options.reduce_dtype) or (torch.float32 if low is not None else None)
    frozen = set(frozen_parameters(model))

    def shard(module: nn.Module) -> None:
        fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=options.reshard_after_forward,
            offload_policy=CPUOffloadPolicy() if options.cpu_offload else OffloadPolicy(),
            mp_policy=MixedPrecisionPolicy(param_dtype=low, reduce_dtype=reduce),
            shard_placement_fn=(
                partial(shard_largest_dim, world_size=mesh.shape[-1]) if options.shard_largest_dim else None
            ),
            ignored_params=frozen,
        )

    for unit in units:
        shard(unit)
    shard(model)
    if low is None and reduce is None:
        return None
    return f"FSDP2 MixedPrecisionPolicy(param_dtype={dtype_name(low)}, reduce_dtype={dtype_name(reduce)})"


class FSDP2Config(FSDP2Options, StrategyConfig):
    """fully_shard (FSDP2): per-parameter DTensor sharding per KAN layer and on the root."""

    name: Literal["fsdp2"]
    shard_degree: int | Literal["world", "node"] = Field(
        "world",
        description="ranks each replica of the model state is sharded over: world (all: full sharding), node "
        "(the ranks of one node, replicated across nodes: HSDP) or a number dividing the world size",
    )

    compiles_step: ClassVar[bool] = True

    def label(self) -> str:
        return self.fsdp2_label("fsdp2" if self.shard_degree == "world" else "hsdp")

    def mesh_shape(self, world_size: int, ranks_per_node: int | None = None) -> MeshShape:
        return MeshShape.hybrid(world_size, self.shard_degree, ranks_per_node, "strategy.shard_degree")

    def cost_model(self) -> StrategyModel | None:
        # each unit gathered before its forward and again before its backward, its gradients
        # reduce-scattered (over the shard group, then all-reduced over the replicas under HSDP);
        # kept through backward (reshard_after_forward false) is not modelled yet
        if not self.reshard_after_forward:
            return None
        hybrid = self.shard_degree != "world"
        return StrategyModel(
            self.label(),
            grads="reduce_scatter",
            gather="per_unit",
            sharded_state=True,
            sharded_params="trainable",
            shard=self.shard_degree,
            one_rank_as=self.fsdp2_label() if hybrid else None,
        )

    def preflight(self, training: TrainingConfig, device_type: str, world_size: int) -> None:
        self.check_fsdp2(training, device_type)

    def apply(self, model: nn.Module, training: TrainingConfig, env: DistEnv) -> Engine:
        hybrid = env.mesh.shape.dp_replicate > 1
        mesh = env.mesh[("dp_replicate", "dp_shard")] if hybrid else env.mesh["dp_shard"]
        cast = apply_fsdp2(model, self.wrap_units(model), mesh, self, training)
        return FSDP2Engine(
            model,
            build_optimizer(model.parameters(), training),
            training,
            env.mesh.dp_size,
            Amp.sharded_scaler(training, env.device.type),
            cast,
        )
