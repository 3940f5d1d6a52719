"""This rank's model and its compute-only baseline, built before the strategy wraps the model.

Every rank builds the same model and then takes rank 0's weights; the baseline that
strategies/measure/ compares the training with is built and warmed up on every rank at the same
time, from the unwrapped model.
"""

from __future__ import annotations

import hashlib

import torch

from kan_models import build_model
from kan_models.compile import compile_model
from kanscale.errors import ConfigError
from strategies.experiment import ExperimentConfig
from strategies.lifecycle.export import read_export
from strategies.loop.activation_checkpointing import apply_activation_checkpointing
from strategies.measure.baseline import ComputeBaseline
from strategies.measure.layerwise import LayerwiseBaseline
from strategies.runtime.distributed import DistEnv
from strategies.runtime.mesh import RunMesh
from strategies.step.engine import Batch


def load_exported(path: str, cfg: ExperimentConfig) -> dict[str, torch.Tensor]:
    """The weights of a ``kanscale export`` file, after checking they are for this model."""
    exported = read_export(path, "training.init_from")
    theirs, ours = exported["model"], cfg.model.model_dump(mode="json")
    differ = [k for k in ("family", "widths", *cfg.model.identity) if theirs.get(k) != ours.get(k)]
    if differ:
        raise ConfigError(
            f"training.init_from: {path} holds a {theirs['family']} {theirs['widths']} model, which differs "
            f"from this experiment's in {', '.join(differ)}; use an export of the same model"
        )
    return exported["model_state"]


def build_rank_model(cfg: ExperimentConfig, env: DistEnv, dtype: torch.dtype) -> torch.nn.Module:
    """The experiment's model on this rank's device, in ``dtype``, holding rank 0's weights."""
    t = cfg.training
    model = build_model(cfg.model, t.seed)
    if t.init_from:
        model.load_state_dict(load_exported(t.init_from, cfg))
    model.to(device=env.device, dtype=dtype)
    # Every rank starts from rank 0's weights: some initialisations (pykan's least-squares
    # fit) are not bitwise reproducible, and not every backend broadcasts them itself. A
    # factory that built another model on some rank would fail inside the broadcast, naming nothing.
    layout = "; ".join(f"{k} {tuple(v.shape)} {v.dtype}" for k, v in model.state_dict().items())
    if differ := env.ranks_differing(hashlib.sha256(layout.encode()).hexdigest()):
        raise ConfigError(
            f"model: rank(s) {differ} built a model other than rank 0's (names, shapes or dtypes of its "
            f"tensors differ); the model ({cfg.model.family}, model.factory where custom) must be built "
            "the same on every rank: do not make it depend on the rank"
        )
    env.broadcast_tensors(list(model.state_dict().values()))
    return model


def checkpoint_activations(model: torch.nn.Module, cfg: ExperimentConfig) -> list[torch.nn.Module]:
    """training.activation_checkpointing on the unwrapped model's units (those FSDP shards one by
    one), before the strategy wraps it; the units checkpointed."""
    t = cfg.training
    if t.activation_checkpointing == "none":
        return []
    units = cfg.strategy.wrap_units(model)
    if not units:
        raise ConfigError(
            "training.activation_checkpointing: this model has no units to checkpoint (no submodule holds "
            "model.wrap.min_params parameters); name its block classes in model.wrap.classes, or set "
            "training.activation_checkpointing=none"
        )
    return apply_activation_checkpointing(units, t.activation_checkpointing_every)


def compile_on_sample(model: torch.nn.Module, sample: torch.Tensor, mode: str) -> float:
    """Compile the (unwrapped) model in place on a batch of the training shape; returns the
    compile time. Backends that replace parameters (FSDP, ZeRO-3) may recompile during the
    first steps, which the warm-up steps absorb."""
    return compile_model(model, sample, **({} if mode == "default" else {"mode": mode}))[1]


def build_baseline(
    kind: str,
    cfg: ExperimentConfig,
    env: DistEnv,
    mesh: RunMesh,
    model: torch.nn.Module,
    batches: tuple[list[Batch], int],
    sample: torch.Tensor,
) -> ComputeBaseline | LayerwiseBaseline | None:
    """The compute-only baseline of ``kind`` (measurement.baseline, resolved; None: off), warmed up
    on ``batches``, this attempt's first; every rank builds its own at the same time, before the
    strategy wraps ``model``. A compiled model's replicas are compiled on ``sample``, as the model was."""
    t, m = cfg.training, cfg.measurement
    baseline: ComputeBaseline | LayerwiseBaseline
    if kind == "off":
        return None
    if kind == "layerwise":
        baseline = LayerwiseBaseline(
            model, cfg.strategy.wrap_units(model), env.device, t, mesh.shape.dp_shard, m.baseline_steps
        )
    else:
        dtype = getattr(torch, t.dtype)

        def replica() -> torch.nn.Module:
            copy = build_model(cfg.model, t.seed).to(device=env.device, dtype=dtype)
            copy.load_state_dict(model.state_dict())
            checkpoint_activations(copy, cfg)  # the same arithmetic as the training's, recomputation included
            if t.compile == "model":
                compile_on_sample(copy, sample, t.compile_mode)  # the model's compiled code is cached by now
            return cfg.strategy.compute_replica(copy, env)

        baseline = ComputeBaseline(replica, env.device, t, m.baseline_steps)
    baseline.warm_up(*batches, cfg.task.loss_sum, steps=min(t.warmup_steps, 3))
    return baseline
