"""What ``kanscale recommend`` measures on this machine before it predicts: each candidate
strategy trained briefly on one rank (its compute, its own bookkeeping per step, and what its
process holds beside the model state, as the suite's records measure them), and the bytes
autograd saves per sample (what the micro-batch adds to a rank's memory).

The one-rank runs are a sweep of the suite's own (launchers/studies/sweep.py), so they are real
runs with records, kept under ``OUT/probe``; a later ``recommend`` with the same ``--out`` reuses
the ones that finished (the sweep's resume)."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from analysis import projection as pj
from analysis.projection.device_time import StepOps
from analysis.projection.memory import StepMemory
from analysis.records.run_files import SUMMARY_FILE, read_summary
from kanscale.writes import atomic_write_text
from strategies.experiment import ExperimentConfig

# A probe run: one warm-up step, then two timing windows of two steps, each followed by one step
# of the one-process replica (the compute the projection starts from).
PROBE_SETTINGS = {
    "training.steps": 5,
    "training.warmup_steps": 1,
    "training.epochs": None,
    "training.checkpoint_every": 0,
    "training.grad_accum": 1,
    "training.global_batch": None,
    "measurement.window_steps": 2,
    "measurement.baseline": "replica",
    "measurement.baseline_steps": 1,
}
# The most arithmetic a probe step does (6 x parameters per sample), so that a probe of a large
# model stays short (docs/recommend.md); compute per sample, the projection's input, is taken as
# linear in the samples above this. Large enough for a 16.7M model's 256 samples: at 119 (a 12
# GFLOP cap) its matrix products ran slower per sample than the training's, and the prediction
# came out 29% under.
PROBE_STEP_FLOP = 32e9


def probe_micro_batch(trainable: int, micro_batch: int) -> int:
    """The samples per probe step: the target's micro-batch, up to PROBE_STEP_FLOP of work."""
    return max(1, min(micro_batch, int(PROBE_STEP_FLOP / (6 * max(trainable, 1)))))


@dataclass(frozen=True)
class Probe:
    """Per strategy label (``*``: any strategy without a run of its own, from the one-process
    reference's) its compute profile and what a rank holds beside the model state."""

    compute: dict[str, pj.ComputeProfile]
    beside: dict[str, StepMemory]  # a process's resident memory (this machine's ranks)
    optimizer_bytes: dict[str, float]  # the optimizer state each strategy's 1-rank run recorded
    device: StepMemory  # what the allocator holds (a GPU rank's device memory)
    micro_batch: int
    runs: Path
    # where rehearsed instead (a GPU target, launchers/recommend/rehearsed.py), per label ("*": the
    # model's own step): the rank's kernels, the optimizer bytes beyond the formula at the target's
    # layout, and where each came from
    steps: dict[str, StepOps] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    # cores other processes kept busy while the probes were timed (median), and the cores there were
    outside_load: tuple[float, int] | None = None

    def outside_load_words(self) -> str | None:
        """What the prediction assumes of other work on this machine: the load the probes met."""
        if self.outside_load is None:
            return None
        busy, cores = self.outside_load
        return (
            f"outside load: other processes kept {busy:.2f} of {cores} cores busy while the probes were timed "
            "(median); the prediction assumes the same load while the training runs (more slows it, less speeds it)"
        )


def keyed_dir(base: Path, identity: Any) -> Path:
    """``base/KEY``, KEY a digest of ``identity`` (the experiment and its settings): a later call
    with the same ``--out`` and the same experiment reuses its runs, and one with another experiment
    writes beside them instead of mixing with them."""
    return base / hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:12]


def probe_study(
    config: Path, overrides: Sequence[str], strategies: Sequence[str], micro_batch: int, base: Path
) -> tuple[Path, Path]:
    """The study of one-rank runs, written beside the directory its runs go to; both paths."""
    settings = {**PROBE_SETTINGS, "training.micro_batch": micro_batch}
    out = keyed_dir(base, [str(config.resolve()), list(overrides), settings])
    study = {
        "study": "recommend-probe",
        "preset": "custom",
        "experiment": str(config.resolve()),
        "description": "kanscale recommend: each candidate strategy on one rank, briefly",
        "set": settings,
        "matrix": {"strategy": list(strategies), "topology": ["1x1"]},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    path = out.with_suffix(".yaml")
    atomic_write_text(path, yaml.safe_dump(study, sort_keys=False))
    return path, out


def device_step_memory(cfg: ExperimentConfig, micro_batch: int) -> StepMemory:
    """What a rank's device holds beside the model state, by the allocator's count: the task's
    data (every rank holds it) and the activations kept per sample, from two micro-batches of the
    task's own data through the model as the experiment builds it (a forward each), checkpointed
    and in the precision the experiment says, on fake tensors where the model allows
    (launchers/recommend/step_ops.py)."""
    from launchers.recommend.step_ops import on_shapes_where_possible

    return on_shapes_where_possible(cfg.model, lambda: _step_memory(cfg, micro_batch))


def _step_memory(cfg: ExperimentConfig, micro_batch: int) -> StepMemory:
    import torch

    from kan_models import build_model
    from launchers.bench import saved_bytes
    from strategies.loop.model_setup import checkpoint_activations

    model = build_model(cfg.model, seed=cfg.training.seed)
    checkpointed = checkpoint_activations(model, cfg)
    data = cfg.task.generate(cfg.training.seed)
    small, large = max(1, micro_batch // 2), max(2, micro_batch)
    index = torch.arange(large) % data.x_train.shape[0]
    x, y = data.x_train[index].float(), data.y_train[index]
    y = y.float() if y.is_floating_point() else y
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.training.precision)
    precision = torch.autocast("cpu", dtype=low) if low else contextlib.nullcontext()

    def saved(n: int) -> int:
        with precision:  # the products' saved inputs in the low dtype, as a GPU's autocast keeps them
            return saved_bytes(model, lambda: cfg.task.loss_sum(model(x[:n]), y[:n]), checkpointed)

    per_sample = max(0.0, (saved(large) - saved(small)) / (large - small))
    held = sum(t.element_size() * t.numel() for t in (data.x_train, data.y_train, data.x_test, data.y_test))
    how = f"activation checkpointing {cfg.training.activation_checkpointing}, {cfg.training.precision}"
    return StepMemory(f"the task's data and activations kept per sample ({how}), counted here", held, per_sample)


def read_probe(runs: Path, device: StepMemory, micro_batch: int) -> Probe:
    """The finished one-rank runs under ``runs``: compute profiles (the projection's own reading of
    one-rank runs) and, per strategy, its peak less its model state as the fixed part of what a
    rank holds beside the state."""
    compute, _ = pj.profiles_from_runs(runs)
    beside: dict[str, list[float]] = {}
    optimizer: dict[str, float] = {}
    references = []
    loads: list[tuple[float, int]] = []
    for summary in runs.rglob(SUMMARY_FILE):
        record = read_summary(summary)
        held = record.memory  # a finished record has it (RunRecord's validator)
        if record.status != "ok" or record.topology.world_size != 1 or held is None:
            continue
        load = record.measurement.outside_load if record.measurement else None
        if load is not None:
            loads.append((load.cores_busy, load.cores))
        peak = held.peak_device_bytes or held.peak_rss_bytes
        state = sum(held.model_state.model_dump().values())
        beside.setdefault(record.strategy.label, []).append(peak - state - device.per_sample * micro_batch)
        optimizer[record.strategy.label] = held.model_state.optimizer
        if record.strategy.reference:
            references.append(record.strategy.label)
    where = f"peak less model state of its own 1-rank run under {runs}"
    memory = {
        label: StepMemory(
            f"{label}: {where}", fixed=max(0.0, sorted(values)[len(values) // 2]), per_sample=device.per_sample
        )
        for label, values in beside.items()
    }
    reference = (references or sorted(memory))[0]  # the one-process reference's, as compute's "*" is
    memory["*"] = StepMemory(
        f"{reference}'s {where}, for strategies without their own", memory[reference].fixed, device.per_sample
    )
    optimizer["*"] = optimizer[reference]
    outside = sorted(loads)[len(loads) // 2] if loads else None
    return Probe(compute, memory, optimizer, device, micro_batch, runs, outside_load=outside)


def probe_summary(probe: Probe) -> dict[str, Any]:
    """The probe as the JSON document records it."""
    if probe.steps:
        return {
            "rehearsed": probe.sources,
            "micro_batch": probe.micro_batch,
            "saved_bytes_per_sample": probe.device.per_sample,
            "data_bytes": probe.device.fixed,
            "kernels": {label: step.kernels for label, step in probe.steps.items()},
            "optimizer_bytes_beyond_formula": probe.counters,
        }
    return {
        "runs": str(probe.runs),
        "micro_batch": probe.micro_batch,
        "saved_bytes_per_sample": probe.device.per_sample,
        "data_bytes": probe.device.fixed,
        "compute": {
            label: {
                "source": p.source,
                "samples": p.samples,
                "compute_s": p.compute_s,
                "data_s": p.data_s,
                "overhead_s": p.overhead_s,
            }
            for label, p in probe.compute.items()
        },
        "beside_state_bytes": {label: m.fixed for label, m in probe.beside.items()},
        "outside_cores_busy": probe.outside_load[0] if probe.outside_load else None,
    }


def compute_spread(runs: Path) -> float:
    """The probes' relative spread between timing windows (median over runs): half the range of
    the windows' rates over their median."""
    spreads = []
    for summary in runs.rglob(SUMMARY_FILE):
        t = read_summary(summary).throughput
        if t and t.samples_per_s and t.samples_per_s_low is not None and t.samples_per_s_high is not None:
            spreads.append((t.samples_per_s_high - t.samples_per_s_low) / (2 * t.samples_per_s))
    return sorted(spreads)[len(spreads) // 2] if spreads else 0.0
