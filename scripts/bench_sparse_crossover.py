"""Where does the fast B-spline layer's sparse product start to beat its dense one? One layer's
forward and backward, dense and sparse side by side at each grid size, on one thread; prints
the step times, their ratio and the largest relative difference of output and gradients.
``SPARSE_FROM`` in kan_models/bspline_fast.py is set from this (docs/performance.md).

    python scripts/bench_sparse_crossover.py                      # CPU, grids 10 40 80 160
    python scripts/bench_sparse_crossover.py --device cuda --grids 10 40 80 160 320
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kan_models import build_model, parse_model_config  # noqa: E402


def layer_step(grid: int, product: str, args: argparse.Namespace) -> tuple[float, list[torch.Tensor]]:
    """The best of ``args.repeats`` forward + backward times (ms) of one layer, and its output and gradients."""
    cfg = parse_model_config({"family": "bspline", "widths": [args.inputs, args.outputs], "grid": grid, "k": args.k,
                              "product": product})
    model = build_model(cfg, 0).to(args.device)
    x = (torch.rand(args.batch, args.inputs, generator=torch.Generator().manual_seed(0)) * 2 - 1).to(args.device)
    x.requires_grad_()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        x.grad = None
        out = model(x)
        out.square().mean().backward()
        return out

    step()
    best = float("inf")
    for _ in range(args.repeats):
        sync()
        start = time.perf_counter()
        out = step()
        sync()
        best = min(best, time.perf_counter() - start)
    return best * 1e3, [out.detach(), x.grad, *(p.grad for p in model.parameters())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grids", type=int, nargs="+", default=[10, 40, 80, 160])
    parser.add_argument("--inputs", type=int, default=256)
    parser.add_argument("--outputs", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"one B-spline layer [{args.inputs}, {args.outputs}], k {args.k}, batch {args.batch}, {args.device}, "
          "forward + backward, best of", args.repeats)
    print("| grid | bases per non-zero | dense ms | sparse ms | dense / sparse | max rel. difference |")
    print("|---:|---:|---:|---:|---:|---:|")
    for grid in args.grids:
        dense_ms, dense = layer_step(grid, "dense", args)
        sparse_ms, sparse = layer_step(grid, "sparse", args)
        diff = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(sparse, dense))
        print(f"| {grid} | {(grid + args.k) / (args.k + 1):.1f} | {dense_ms:,.0f} | {sparse_ms:,.0f} | "
              f"{dense_ms / sparse_ms:.2f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
