"""Where does the fast B-spline layer's sparse product start to beat its dense one? One layer's
forward and backward, dense and sparse side by side at each grid size, on one thread; prints
the step times, their ratio, the largest relative difference of output and gradients, and where
the two break even. With ``--save`` that break-even becomes this CPU's crossover for
``product: auto`` (kan_models/sparse_crossover.py; docs/performance.md).

    python scripts/bench_sparse_crossover.py --save               # CPU, grids 10 20 40 80 160
    python scripts/bench_sparse_crossover.py --device cuda --grids 10 40 80 160 320
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kan_models import build_model, parse_model_config
from kan_models.sparse_crossover import break_even, machine_key, save_crossover


def layer_step(grid: int, product: str, args: argparse.Namespace) -> tuple[float, list[torch.Tensor]]:
    """The best of ``args.repeats`` forward + backward times (ms) of one layer, and its output and gradients."""
    cfg = parse_model_config(
        {"family": "bspline", "widths": [args.inputs, args.outputs], "grid": grid, "k": args.k, "product": product}
    )
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
    parser.add_argument("--grids", type=int, nargs="+", default=[10, 20, 40, 80, 160])
    parser.add_argument("--inputs", type=int, default=256)
    parser.add_argument("--outputs", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--save", action="store_true", help="store the break-even as this CPU's crossover for product: auto (CPU only)"
    )
    args = parser.parse_args()
    if args.save and args.device != "cpu":
        parser.error("--save stores a CPU's crossover; product: auto stays dense on CUDA")
    torch.set_num_threads(1)
    print(
        f"one B-spline layer [{args.inputs}, {args.outputs}], k {args.k}, batch {args.batch}, {args.device}, "
        "forward + backward, best of",
        args.repeats,
    )
    print("| grid | bases per non-zero | dense ms | sparse ms | dense / sparse | max rel. difference |")
    print("|---:|---:|---:|---:|---:|---:|")
    table = []
    for grid in args.grids:
        dense_ms, dense = layer_step(grid, "dense", args)
        sparse_ms, sparse = layer_step(grid, "sparse", args)
        diff = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(sparse, dense, strict=True))
        bases = (grid + args.k) / (args.k + 1)
        table.append(
            {
                "grid": grid,
                "bases_per_nonzero": round(bases, 2),
                "dense_ms": round(dense_ms, 2),
                "sparse_ms": round(sparse_ms, 2),
            }
        )
        print(
            f"| {grid} | {bases:.1f} | {dense_ms:,.0f} | {sparse_ms:,.0f} | {dense_ms / sparse_ms:.2f} | {diff:.1e} |",
            flush=True,
        )
    even = break_even([(row["bases_per_nonzero"], row["dense_ms"] / row["sparse_ms"]) for row in table])
    if even is None:
        print(f"sparse never won up to grid {max(args.grids)}: nothing to store; try larger --grids")
        sys.exit(1 if args.save else 0)
    print(f"dense and sparse break even at {even:.2f} bases per non-zero (interpolated) on {machine_key()}")
    if args.save:
        path = save_crossover(even, datetime.date.today().isoformat(), table)
        print(f"stored in {path}: product auto multiplies sparsely from there on this CPU")


if __name__ == "__main__":
    main()
