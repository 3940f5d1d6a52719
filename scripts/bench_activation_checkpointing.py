"""What activation checkpointing saves and costs, per model family, in one process: the peak of a
training step by category (torch's MemTracker: parameters, gradients, optimizer state,
activations, temporaries) and the activations kept at the end of the forward, without and with
``training.activation_checkpointing: layers`` (the suite's own function,
strategies/loop/model_setup.py), and the step time with over without
(median of several steps, the pairs side by side). docs/memory.md shows its table.

    python scripts/bench_activation_checkpointing.py
    python scripts/bench_activation_checkpointing.py --widths 32,512,512,512,1 --batch 2048 --families rbf
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kan_models import build_model  # noqa: E402
from strategies.experiment import load_experiment  # noqa: E402
from strategies.loop.model_setup import checkpoint_activations  # noqa: E402

FAMILIES = {  # the four: the B-spline layer's reference and fast implementations among them
    "bspline-reference": ["model.family=bspline", "model.impl=reference"],
    "rbf": ["model.family=rbf"],
    "chebyshev": ["model.family=chebyshev"],
    "bspline-fast": ["model.family=bspline", "model.impl=fast"],
}
MiB = 2**20


def step_memory(family: str, widths: str, batch: int, mode: str, steps: int) -> tuple[dict[str, float], float, float]:
    """The first step's peak by category (MiB), the activations kept at the end of its forward
    (MiB: what backward will need), and the median time of ``steps`` more steps."""
    from torch.distributed._tools.mem_tracker import MemTracker

    settings = [*FAMILIES[family], f"model.widths=[{widths}]", "task.name=high_dim"]
    settings += [f"task.dim={widths.split(',')[0]}", f"training.activation_checkpointing={mode}"]
    cfg = load_experiment("quickstart", settings)
    model = build_model(cfg.model, seed=0)
    checkpoint_activations(model, cfg)
    optimizer = torch.optim.Adam(model.parameters())
    x = torch.randn(batch, int(widths.split(",")[0]), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:  # one step per tracker: it refuses a second iteration in one context
        loss = model(x).square().mean()
        (kept,) = tracker.get_tracker_snapshot("current").values()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    (peak,) = tracker.get_tracker_snapshot("peak").values()
    by_name = {str(getattr(k, "value", k)): v / MiB for k, v in peak.items()}  # MemTracker's keys are str enums
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    activations = sum(v for k, v in kept.items() if getattr(k, "value", k) == "Activation") / MiB
    return by_name, activations, statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", default="32,512,512,512,1", help="model.widths (default: the issue's)")
    parser.add_argument("--batch", type=int, default=2048, help="samples per step (default: 2048)")
    parser.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated, of {', '.join(FAMILIES)}")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per mode (default: 5)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"widths [{args.widths}], batch {args.batch}, one process, 1 thread; MemTracker's peak of the first step")
    print(
        "| model | peak without (MiB) | peak with | activations kept after forward, without / with | "
        "activations at the peak, without / with | step time with / without |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for family in args.families.split(","):
        (without, kept0, t0), (with_, kept1, t1) = (
            step_memory(family, args.widths, args.batch, mode, args.steps) for mode in ("none", "layers")
        )
        at_peak = f"{without['Activation']:,.1f} / {with_['Activation']:,.1f}"
        print(
            f"| {family} | {without['Total']:,.0f} | {with_['Total']:,.0f} | {kept0:,.1f} / {kept1:,.1f} | {at_peak} "
            f"| {t1 / t0:.2f}x |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
