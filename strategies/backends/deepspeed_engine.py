"""The engine of the ``deepspeed`` strategy (and of Accelerate's DeepSpeed plugin): a DeepSpeed
engine's step, checkpoints, model state and weights in the suite's terms."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from analysis.records.schema import ModelStateBytes
from strategies.backends.deepspeed_config import OPTION_KEYS, get_path
from strategies.sections import TrainingConfig
from strategies.step.engine import Engine, detached_copy, optimizer_state_tensors, tensor_bytes
from strategies.step.precision import LOW_DTYPES


def zero_label(stage: int, offloaded: bool) -> str:
    return f"zero{stage}" + ("_offload" if offloaded else "")


def initial_weights(model: nn.Module, training: TrainingConfig) -> dict[str, torch.Tensor] | None:
    """Under bf16/fp16, the model's full-precision weights before DeepSpeed casts it (see DeepSpeedEngine)."""
    return detached_copy(model.state_dict()) if training.precision != "fp32" else None


def master_tensors(zero: Any) -> list[torch.Tensor]:
    """The float32 master copies a DeepSpeed optimizer keeps: ZeRO 1-2's and 3's partitions, or
    under bf16/fp16 at stage 0 whole copies; none in full precision at stage 0."""
    return list(
        getattr(zero, "single_partition_of_fp32_groups", None)
        or getattr(zero, "fp32_partitioned_groups_flat", None)
        or [m for group in getattr(zero, "fp32_groups", None) or [] for m in group]
    )


def deepspeed_state_bytes(ds_engine: Any) -> ModelStateBytes:
    """What a DeepSpeed engine holds on this rank. ZeRO keeps the module's working parameters
    (stage 3: only this rank's partition, ``ds_tensor``, between uses, and under ZeRO++ hpZ its
    node's partition too), fp32 master partitions of
    them, reduced gradient partitions, and the wrapped optimizer's state on the master partitions.
    Under bf16/fp16 the working parameters are 16-bit and the masters float32, at stage 0 too."""
    zero = ds_engine.optimizer
    params = list(ds_engine.module.parameters())
    # ZeRO++ hpZ keeps a second partition of each parameter over its node's ranks (ds_secondary_tensor)
    partitions = [
        t
        for p in params
        for t in (getattr(p, "ds_tensor", None), getattr(p, "ds_secondary_tensor", None))
        if t is not None
    ]
    masters = master_tensors(zero)
    averaged = getattr(zero, "averaged_gradients", None) or {}
    averaged = [
        g
        for group in (averaged.values() if isinstance(averaged, dict) else averaged)
        for g in (group or [])
        if g is not None
    ]
    inner = getattr(zero, "optimizer", zero)
    return ModelStateBytes(
        params=tensor_bytes(p.data for p in params) + tensor_bytes(partitions),
        grads=tensor_bytes(p.grad for p in params if p.grad is not None)
        + tensor_bytes(averaged)
        + tensor_bytes(m.grad for m in masters if m.grad is not None),
        optimizer=tensor_bytes(optimizer_state_tensors(inner)),
        master_params=tensor_bytes(masters),
    )


class DeepSpeedEngine(Engine):
    checkpoint_format = "deepspeed"
    TAG = "state"

    def __init__(
        self,
        ds_engine: Any,
        training: TrainingConfig,
        world_size: int,
        ds_config: dict[str, Any],
        initial: dict[str, torch.Tensor] | None = None,
    ) -> None:
        super().__init__(ds_engine, ds_engine.optimizer, training)
        self.ds = ds_engine
        self.world_size = world_size
        self.ds_config = ds_config
        self.stage = ds_engine.zero_optimization_stage()
        self._boundary = True
        offloaded = any(
            get_path(ds_config, OPTION_KEYS[k]) not in (None, "none") for k in ("offload_optimizer", "offload_param")
        )
        self.kind = zero_label(self.stage, offloaded)
        low = next((LOW_DTYPES[key] for key in LOW_DTYPES if get_path(ds_config, (key, "enabled"))), None)
        if low is not None:
            # DeepSpeed casts the module, not its inputs; the optimizer steps float32 masters.
            self.input_dtype = low
            self.precision_mechanism = f"DeepSpeed {'bf16' if low == torch.bfloat16 else 'fp16 (dynamic loss scaling)'}"
            self._start_like_the_others(initial)

    def gradient_sync(self, enabled: bool):
        self._boundary = enabled
        return super().gradient_sync(enabled)

    def backward(self, loss: torch.Tensor) -> None:
        # DeepSpeed divides the loss by gradient_accumulation_steps and averages gradients over
        # ranks; undo both so the gradient is that of the global-batch mean.
        self.ds.backward(loss * (self.world_size * self.training.grad_accum))
        if not self._boundary:
            self.ds.step()  # DeepSpeed counts micro-steps in step(); off the boundary it only counts

    def step(self, count_state: bool = False) -> None:
        if count_state:
            self.counted_state = self.model_state_bytes()
        self.ds.step()  # clipping comes from the config's gradient_clipping

    def model_state_bytes(self) -> ModelStateBytes:
        return deepspeed_state_bytes(self.ds)

    def updated_tensors(self) -> list[torch.Tensor]:
        # ZeRO-3 empties its optimizer's param groups between steps; its masters are what it updates.
        return master_tensors(self.ds.optimizer) or super().updated_tensors()

    def save(self, directory: Path) -> None:
        self.ds.save_checkpoint(str(directory), tag=self.TAG, save_latest=False)

    @staticmethod
    def consolidate(directory: Path) -> dict[str, torch.Tensor]:
        """ZeRO 1-3 keep the authoritative fp32 weights in their optimizer partitions, which
        zero_to_fp32 merges; stage 0 saves the whole module. Buffers (spline knots) come from the
        saved module either way."""
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        tag_dir = directory / DeepSpeedEngine.TAG
        # mp_rank_00_model_states.pt, or under ZeRO-3 zero_pp_rank_0_mp_rank_00_model_states.pt
        module = torch.load(sorted(tag_dir.glob("*model_states.pt"))[0], map_location="cpu", weights_only=False)[
            "module"
        ]
        if not any(tag_dir.glob("*optim_states.pt")) or not any(tag_dir.glob("zero_pp_rank_*")):
            return module
        state = get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=DeepSpeedEngine.TAG)
        return {**{k: v for k, v in module.items() if k not in state}, **state}

    def load(self, directory: Path) -> None:
        self.ds.load_checkpoint(
            str(directory), tag=self.TAG, load_optimizer_states=True, load_lr_scheduler_states=False
        )

    @torch.no_grad()
    def _start_like_the_others(self, initial: dict[str, torch.Tensor] | None) -> None:
        """Under bf16/fp16 DeepSpeed (0.19) starts from another point than every other strategy,
        as the bf16 parity tests show: it makes its float32 masters from the module after
        casting it to 16 bits, which rounds the initial weights, and at stage 0 it creates the
        optimizer's state with one step on zero gradients, which leaves Adam's moments at zero but
        its step count at 1, so every later bias correction is one step off (the first update is
        0.74 lr instead of lr). Start from the suite's weights and, at stage 0, a fresh step count."""
        if initial is not None:
            self.load_full_state_dict(initial)
        if self.stage > 0:
            return
        inner = getattr(self.ds.optimizer, "optimizer", self.ds.optimizer)
        for state in inner.state.values():
            if "step" in state:
                state["step"] = torch.zeros_like(state["step"]) if isinstance(state["step"], torch.Tensor) else 0

    def _stage0_masters(self) -> dict[int, torch.Tensor]:
        """Stage 0 under bf16/fp16: the float32 master of each module parameter (by id), which its
        optimizer keeps in lists beside the module's 16-bit ones; ZeRO 1-3 map theirs themselves."""
        opt = self.ds.optimizer
        # an optimizer without the two lists (ZeRO's) gives no masters
        return {
            id(low): high
            for lows, highs in zip(getattr(opt, "fp16_groups", []), getattr(opt, "fp32_groups", []), strict=False)
            for low, high in zip(lows, highs, strict=False)
        }

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param

        module = self.ds.module
        gather = deepspeed.zero.GatheredParameters(
            list(module.parameters()), modifier_rank=None, enabled=self.stage == 3
        )
        with gather:
            state = detached_copy(module.state_dict())
        if self.input_dtype is None:
            return state  # full precision: the module's parameters are the weights
        # Under bf16/fp16 the weights are the float32 masters (every rank takes part in gathering them).
        masters = self._stage0_masters()
        for name, param in module.named_parameters():
            master = safe_get_full_fp32_param(param) if self.stage > 0 else masters.get(id(param))
            if master is not None:
                state[name] = master.detach().clone()
        dtype = getattr(torch, self.training.dtype)
        return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param

        module = self.ds.module
        names = dict(module.named_parameters())
        with deepspeed.zero.GatheredParameters(list(names.values()), modifier_rank=0, enabled=self.stage == 3):
            module.load_state_dict(state)  # the working copy the forward pass uses
        masters = self._stage0_masters()
        for name, param in names.items():  # and the fp32 masters, which the next step copies back
            if self.stage > 0:
                safe_set_full_fp32_param(param, state[name].to(torch.float32))
            elif id(param) in masters:
                masters[id(param)].copy_(state[name])

    def distributed_type(self) -> str:
        return f"DEEPSPEED_ZERO{self.stage}"

    def backend_config(self) -> dict[str, Any]:
        return json.loads(json.dumps(self.ds_config, default=str))  # plain JSON, for the record
