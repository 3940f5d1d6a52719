"""``fsdp1``: PyTorch FullyShardedDataParallel (the original, flat-parameter FSDP). One FSDP
unit per KAN layer, so only one layer's parameters are gathered at a time. Its hybrid sharding
strategies shard inside groups of ``shard_degree`` ranks (one node's by default) and replicate
across them, over the run mesh's (dp_replicate, dp_shard) sub-mesh."""

from __future__ import annotations

import contextlib
from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import nn
from torch.distributed.fsdp import CPUOffload, FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from analysis.projection.strategy_model import StrategyModel
from kanscale.errors import ConfigError
from strategies.backends.dcp import ShardedCheckpoints
from strategies.runtime.distributed import DistEnv
from strategies.runtime.mesh import MeshShape
from strategies.sections import TrainingConfig
from strategies.step.engine import AveragingEngine, Engine, detached_copy, frozen_parameters
from strategies.step.optim import build_optimizer
from strategies.step.precision import Amp, dtype_name, low_dtype
from strategies.strategy import StrategyConfig


class FSDP1Engine(ShardedCheckpoints, AveragingEngine):
    # Under compiled autograd FSDP1's hooks assign the full gradient to the flat shard (a size
    # mismatch): its backward stays eager (strategies/step/compiled_step.py).
    compiled_autograd = False
    kind = "fsdp1"
    model: FSDP

    def gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if enabled else self.model.no_sync()

    def clip_grad_norm(self, max_norm: float) -> None:
        self.model.clip_grad_norm_(max_norm)  # the norm over all ranks' shards

    def _full_state(self) -> contextlib.AbstractContextManager:
        return FSDP.state_dict_type(
            self.model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
        )

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        with self._full_state():
            return detached_copy(self.model.state_dict())

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        with self._full_state():
            self.model.load_state_dict(state)


class FSDP1Config(StrategyConfig):
    """FullyShardedDataParallel (FSDP1): flat parameters sharded per KAN layer."""

    name: Literal["fsdp1"]
    compiles_step: ClassVar[bool] = True
    sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"] = (
        Field(
            "FULL_SHARD",
            description="what is sharded: params+grads+optimizer / grads+optimizer / nothing / FULL_SHARD "
            "within a shard group, replicated across groups / SHARD_GRAD_OP likewise",
        )
    )
    shard_degree: int | Literal["node"] = Field(
        "node",
        description="the hybrid strategies' shard group: node (the ranks of one node) or a number of ranks "
        "dividing the world size",
    )
    cpu_offload: bool = Field(False, description="keep sharded parameters on the CPU between uses (GPU runs)")
    limit_all_gathers: bool = Field(True, description="rate-limit all-gathers to bound memory")
    forward_prefetch: bool = Field(False, description="prefetch the next layer's all-gather in forward")
    use_orig_params: bool = Field(
        True,
        description="expose the original parameters (needed when a layer mixes "
        "trainable and frozen tensors, as pykan's layers do)",
    )

    def label(self) -> str:
        suffix = {
            "FULL_SHARD": "",
            "SHARD_GRAD_OP": "_grad_op",
            "NO_SHARD": "_no_shard",
            "HYBRID_SHARD": "_hybrid",
            "_HYBRID_SHARD_ZERO2": "_hybrid_zero2",
        }
        return "fsdp1" + suffix[self.sharding_strategy]

    @property
    def hybrid(self) -> bool:
        return "HYBRID" in self.sharding_strategy

    def mesh_shape(self, world_size: int, ranks_per_node: int | None = None) -> MeshShape:
        if self.sharding_strategy == "NO_SHARD":
            return MeshShape(dp_replicate=world_size)
        if self.hybrid:
            return MeshShape.hybrid(world_size, self.shard_degree, ranks_per_node, "strategy.shard_degree")
        return MeshShape(dp_shard=world_size)

    def cost_model(self) -> StrategyModel | None:
        # FULL_SHARD gathers each unit before its forward and again before its backward and
        # reduce-scatters its gradients; HYBRID_SHARD the same inside its shard group, then
        # all-reduces the shards across the groups. The other sharding strategies are not modelled yet.
        if self.sharding_strategy not in ("FULL_SHARD", "HYBRID_SHARD"):
            return None
        return StrategyModel(
            self.label(),
            grads="reduce_scatter",
            gather="per_unit",
            sharded_state=True,
            sharded_params="trainable",
            shard=self.shard_degree if self.hybrid else "world",
            one_rank_as="fsdp1" if self.hybrid else None,
        )

    def preflight(self, training: TrainingConfig, device_type: str, world_size: int) -> None:
        if not self.hybrid and self.shard_degree != "node":
            raise ConfigError(
                f"strategy.shard_degree: {self.shard_degree} sets the shard group of the hybrid sharding "
                f"strategies, and sharding_strategy is {self.sharding_strategy}; set "
                "strategy.sharding_strategy=HYBRID_SHARD (or _HYBRID_SHARD_ZERO2), or drop shard_degree"
            )
        if self.cpu_offload and device_type != "cuda":
            raise ConfigError(
                "strategy.cpu_offload: offloading parameters to the CPU needs CUDA devices; "
                "set strategy.cpu_offload=false on a CPU-only machine"
            )

    def apply(self, model: nn.Module, training: TrainingConfig, env: DistEnv) -> Engine:
        blocks = set(self.wrap_units(model))
        low = low_dtype(training)
        # Parameters are gathered in the low dtype for compute; gradients are reduced in float32,
        # as DDP's are under autocast, and the sharded float32 parameters are the master copies.
        # Buffers (spline knots) stay as they are: rounding knots moves every basis function.
        mixed = MixedPrecision(param_dtype=low, reduce_dtype=torch.float32) if low is not None else None
        # Hybrid: the (replicate, shard) mesh; FSDP's own grouping of hybrid ranks counts the GPUs per
        # node, so on CPUs it shards nothing, where the mesh says what to do anywhere.
        mesh = env.mesh[("dp_replicate", "dp_shard")] if self.hybrid else None
        fsdp = FSDP(
            model,
            sharding_strategy=ShardingStrategy[self.sharding_strategy],
            device_mesh=mesh,
            auto_wrap_policy=lambda module, recurse, nonwrapped_numel: recurse or module in blocks,
            cpu_offload=CPUOffload(offload_params=self.cpu_offload),
            device_id=env.device,
            limit_all_gathers=self.limit_all_gathers,
            forward_prefetch=self.forward_prefetch,
            use_orig_params=self.use_orig_params,
            ignored_states=frozen_parameters(model),
            mixed_precision=mixed,
        )
        cast = (
            f"FSDP1 MixedPrecision(param_dtype={dtype_name(low)}, reduce_dtype=float32)" if mixed is not None else None
        )
        return FSDP1Engine(
            fsdp,
            build_optimizer(fsdp.parameters(), training),
            training,
            env.world_size,
            Amp.sharded_scaler(training, env.device.type),
            cast,
        )
