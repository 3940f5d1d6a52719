"""What ranks sharing a machine's cores (CPU ranks) do to each other's compute, measured inside
``kanscale commbench`` (launchers/commbench.py runs it on CPUs and writes its rows as the
document's ``shared_cores``; analysis/projection/shared_cores.py reads them for recommend).

They compute slower together than one alone, and at every collective the first to arrive waits
for the last: what a one-rank probe cannot see. The same work is timed on rank 0 alone while the
others wait, then on every rank at once, each step ended by a 4-byte all-reduce."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist

from analysis.report.tables import markdown
from strategies.runtime.distributed import DistEnv

# The compute lengths per step timed (recommend reads the factor at its step's; docs/projection.md).
COMPUTE_S = (1e-3, 4e-3, 16e-3, 64e-3)
FEWEST_ITERS = 15  # steps timed at one length, at least


def measure_shared_cores(env: DistEnv) -> list[dict[str, Any]]:
    """One row per length of COMPUTE_S; every rank runs it, rank 0's rows are the ones written."""
    return [time_shared_cores(env, compute_s) for compute_s in COMPUTE_S]


def units_in(compute_s: float, unit: Callable[[], None], calibrate_s: float = 0.02) -> int:
    """How many calls of ``unit`` take ``compute_s``: each call timed for ``calibrate_s``, their
    median taken. A total over the window would not do: one stall in it (another process given
    the core, as on a loaded machine) made a 16 ms length measure under 2 ms."""
    times: list[float] = []
    end = time.perf_counter() + calibrate_s
    while time.perf_counter() < end or len(times) < 5:
        start = time.perf_counter()
        unit()
        times.append(time.perf_counter() - start)
    return max(1, round(compute_s / statistics.median(times)))


def time_shared_cores(env: DistEnv, compute_s: float) -> dict[str, Any]:
    """About ``compute_s`` of a training step's kind of work (a small network's forward, backward
    and Adam steps) alone and together: per step, the slowest rank's time, the all-reduce's own
    latency taken off. ``factor``, together over alone (means), is what ranks sharing this machine
    multiply compute by; its range, the ends."""
    layers = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.Adam(layers.parameters())
    x, one = torch.randn(64, 64), torch.ones(1)

    def unit() -> None:
        layers(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(10):  # warm
        unit()
    box = [units_in(compute_s, unit)]
    dist.broadcast_object_list(box, src=0)  # rank 0's count: every rank does the same work
    # short steps vary most: more of them, about half a second of each kind in all
    iters = min(200, max(FEWEST_ITERS, round(0.5 / compute_s)))

    def work() -> None:
        for _ in range(box[0]):
            unit()

    alone, latency = [], []
    for _ in range(iters):
        env.barrier()
        if env.is_main:
            start = time.perf_counter()
            work()
            alone.append(time.perf_counter() - start)
    for _ in range(iters):
        env.barrier()
        start = time.perf_counter()
        dist.all_reduce(one)
        latency.append(time.perf_counter() - start)
    together = torch.zeros(iters, dtype=torch.float64)
    for i in range(iters):
        env.barrier()
        start = time.perf_counter()
        work()
        dist.all_reduce(one)
        together[i] = time.perf_counter() - start - statistics.median(latency)
    dist.all_reduce(together, op=dist.ReduceOp.MAX)
    # means, not medians: a rate is samples over the whole time, the slow steps included; the
    # range, the means of its four quarters in time (how much the outside load moved meanwhile)
    base = statistics.fmean(alone) if env.is_main else 1.0
    steps = together.tolist()
    quarters = [statistics.fmean(steps[len(steps) * i // 4 : len(steps) * (i + 1) // 4]) for i in range(4)]
    return {
        "compute_s": base,
        "together_s": statistics.fmean(steps),
        "factor": statistics.fmean(steps) / base,
        "factor_low": min(quarters) / base,
        "factor_high": max(quarters) / base,
        "iters": iters,
    }


def shared_cores_markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as commbench's Markdown prints them (nothing where none were measured)."""
    if not rows:
        return ""
    table = pd.DataFrame(
        [
            {
                "compute alone ms": f"{1e3 * r['compute_s']:.2f}",
                "together ms (slowest rank)": f"{1e3 * r['together_s']:.2f}",
                "factor [range]": f"{r['factor']:.2f} [{r['factor_low']:.2f}-{r['factor_high']:.2f}]",
            }
            for r in rows
        ]
    )
    return (
        "\nRanks sharing this machine's cores: the same work on rank 0 alone, then on every rank at once "
        "with a 4-byte all-reduce after it (its own latency taken off), mean over "
        f"{rows[-1]['iters']} to {rows[0]['iters']} steps [range: the means of their four quarters]."
        "\n\n" + markdown(table) + "\n"
    )
