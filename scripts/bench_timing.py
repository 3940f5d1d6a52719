"""Does the suite's clock slow the training it measures? Its DDP step rate, as its run record
reports it, against a hand-written DDP loop over the same model, data, batch and optimizer,
interleaved round by round in one process group so both see the same machine.

    torchrun --nproc-per-node 2 scripts/bench_timing.py            # CPU, gloo
    torchrun --nproc-per-node 2 scripts/bench_timing.py --device cuda   # GPUs, nccl

Prints, per model, the median of the rounds' ratios (>= 0.97 is the target of docs/metrics.md), their
range, and a bootstrap 95% interval of that median, with what it says of the target: met (the whole
interval at or above it), missed (below it), or within noise (the interval holds it). Round to round
the ratio moves by tens of percent on a 2-core machine, so one median alone says little. For the
suite with its default windowed timing, and with ``measurement.timing=per_step`` (a barrier around
every step, as kanscale 0.2 timed) for comparison. Writes JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kan_models import build_model, count_parameters
from strategies.experiment import ExperimentConfig, parse_experiment
from strategies.loop.trainer import Trainer
from strategies.runtime.distributed import DistEnv

MODELS: dict[str, dict] = {
    "study [2, 64, 1] pykan": {
        "model": {"family": "pykan", "widths": [2, 64, 1], "grid": 10, "k": 3, "seed": 42},
        "task": {"name": "quadratic"},
    },
    "1M [8, 256, 256, 1] bspline": {
        "model": {"family": "bspline", "widths": [8, 256, 256, 1], "grid": 10, "k": 3},
        "task": {"name": "high_dim", "dim": 8},
    },
    # the study's size with the fused layer: a step short enough that per-step bookkeeping shows
    "study [2, 64, 1] fused": {
        "model": {"family": "bspline", "widths": [2, 64, 1], "grid": 10, "k": 3, "impl": "fused"},
        "task": {"name": "quadratic"},
    },
}


def experiment(
    spec: dict,
    steps: int,
    warmup: int,
    batch: int,
    world: int,
    device: str,
    out: str,
    timing: str = "windowed",
    overrides: Sequence[str] = (),
) -> ExperimentConfig:
    return parse_experiment(
        {
            "name": "bench_timing",
            **spec,
            "task": {**spec["task"], "n_train": batch * world * (steps + warmup), "n_test": 256},
            "training": {
                "seed": 0,
                "optimizer": "adam",
                "lr": 1e-3,
                "micro_batch": batch,
                "steps": steps + warmup,
                "warmup_steps": warmup,
            },
            "strategy": {"name": "ddp"},
            "measurement": {"timing": timing},
            "runtime": {"device": device, "threads": 1},
            "output": {"dir": out},
        },
        overrides,
    )


def hand_written(cfg: ExperimentConfig, env: DistEnv, steps: int, warmup: int) -> float:
    """Samples/s of the plainest DDP loop: forward, MSE, backward, Adam step, from the same
    data; timed by the wall clock from a barrier before the first timed step to one after the last."""
    data = cfg.task.generate(cfg.training.seed).to(env.device, torch.float32)
    model = build_model(cfg.model, cfg.training.seed).to(env.device)
    ddp = DistributedDataParallel(model, device_ids=[env.device.index] if env.device.type == "cuda" else None)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=cfg.training.lr)
    batch = cfg.training.micro_batch
    # Shuffled samples, gathered per step, as the suite's batches are.
    order = torch.randperm(data.x_train.shape[0], generator=torch.Generator().manual_seed(0)).to(env.device)
    start = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            env.synchronize()
            start = time.perf_counter()
        first = (step * env.world_size + env.rank) * batch
        indices = order[first : first + batch]
        x, y = data.x_train[indices], data.y_train[indices]
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    env.synchronize()
    return steps * batch * env.world_size / (time.perf_counter() - start)


def suite(cfg: ExperimentConfig, env: DistEnv) -> float:
    return Trainer(cfg, env, show_progress=False).run().throughput.samples_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=512, help="samples per rank per step (the study's 512)")
    parser.add_argument(
        "--models",
        nargs="+",
        choices=list(MODELS),
        default=list(MODELS),
        metavar="MODEL",
        help=f"which of: {'; '.join(MODELS)}",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override for the suite's runs, e.g. measurement.window_steps=20",
    )
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    env = DistEnv.from_environ(args.device)
    env.init_process_group(timeout_s=300)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = env.broadcast_string(tmp)
        for name in args.models:
            spec = MODELS[name]

            def make(timing: str = "windowed", spec: dict = spec) -> ExperimentConfig:
                return experiment(
                    spec, args.steps, args.warmup, args.batch, env.world_size, args.device, out, timing, args.set
                )

            rows: dict[str, list[float]] = {"hand-written": [], "suite": [], "suite per_step": []}
            for _ in range(args.rounds):  # interleaved: drift hits all three alike
                rows["hand-written"].append(hand_written(make(), env, args.steps, args.warmup))
                rows["suite"].append(suite(make(), env))
                rows["suite per_step"].append(suite(make("per_step"), env))
            params = count_parameters(build_model(make().model, 0)).trainable
            results[name] = {
                "params": params,
                "samples_per_s": rows,
                "ratio": [s / h for s, h in zip(rows["suite"], rows["hand-written"], strict=True)],
                "ratio_per_step": [s / h for s, h in zip(rows["suite per_step"], rows["hand-written"], strict=True)],
            }
    if env.is_main:
        report(results, args, env)
    env.shutdown()


TARGET = 0.97


def median_interval(values: list[float], resamples: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """A bootstrap 95% interval of the median of ``values`` (the rounds resampled with replacement)."""
    rounds = np.asarray(values)
    draws = np.random.default_rng(seed).choice(rounds, size=(resamples, len(rounds)))
    low, high = np.percentile(np.median(draws, axis=1), [2.5, 97.5])
    return float(low), float(high)


def verdict(low: float, high: float) -> str:
    if low >= TARGET:
        return f"met (>= {TARGET})"
    if high < TARGET:
        return f"missed (< {TARGET})"
    return f"within noise of {TARGET}"


def report(results: dict, args: argparse.Namespace, env: DistEnv) -> None:
    print(
        f"\n{env.world_size} ranks on {args.device}, batch {args.batch} per rank, {args.steps} timed steps, "
        f"{args.rounds} interleaved rounds\n"
    )
    print(
        "| model | params | hand-written samples/s | suite / hand-written (median [min-max]) | 95% interval of "
        "the median | target | suite per_step / hand-written |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        hand = statistics.median(r["samples_per_s"]["hand-written"])
        cell = lambda v: f"{statistics.median(v):.3f} [{min(v):.3f}-{max(v):.3f}]"  # noqa: E731
        low, high = r["median_interval"] = median_interval(r["ratio"])
        print(
            f"| {name} | {r['params']:,} | {hand:,.0f} | {cell(r['ratio'])} | {low:.3f}-{high:.3f} | "
            f"{verdict(low, high)} | {cell(r['ratio_per_step'])} |"
        )
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {"device": args.device, "world_size": env.world_size, **vars(args), "results": results}, indent=2
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
