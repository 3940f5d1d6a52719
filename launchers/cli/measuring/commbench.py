"""``kanscale commbench``: the user's flags; launchers.commbench starts the ranks and runs the benchmark."""

from __future__ import annotations

import argparse

from launchers.cli.common import common_options


def register(subcommands: argparse._SubParsersAction) -> None:
    commbench = subcommands.add_parser(
        "commbench",
        parents=[common_options()],
        help="time all-reduce, reduce-scatter and all-gather over message sizes",
        description="Start the ranks under torchrun and time all-reduce, reduce-scatter and all-gather "
        "(and a per-rank host copy) over a sweep of message sizes that includes the zoo's "
        "gradient, shard and DDP-bucket sizes: latency, algorithm and bus bandwidth "
        "(nccl-tests definitions), and a fit of latency (alpha) and inverse bandwidth (beta) "
        "for the link the ranks span. gloo on CPUs, NCCL on GPUs; writes JSON and a Markdown "
        "table (docs/projection.md).",
    )
    commbench.add_argument("--nproc-per-node", type=int, default=2, metavar="G", help="ranks per node (default 2)")
    commbench.add_argument(
        "--nnodes",
        type=int,
        default=1,
        metavar="N",
        help="nodes; with a local --master-addr all N start here, so the ranks talk over an "
        "inter-node link on 127.0.0.1",
    )
    commbench.add_argument(
        "--node-rank",
        type=int,
        default=0,
        metavar="R",
        help="this node, when --master-addr is another host (start the command on every node)",
    )
    commbench.add_argument("--master-addr", default="127.0.0.1", metavar="A", help="address of node 0")
    commbench.add_argument(
        "--master-port",
        type=int,
        metavar="P",
        help="rendezvous port (default: MASTER_PORT if exported, else a free one here, 29500 across hosts)",
    )
    commbench.add_argument("--min-bytes", type=int, default=4, help="smallest message (default 4)")
    commbench.add_argument(
        "--max-bytes", type=int, help="largest message (default: the 20M-parameter model's gradients)"
    )
    commbench.add_argument(
        "--iters", type=int, default=20, help="timed iterations per size, fewer above 4 MiB (default 20)"
    )
    commbench.add_argument("--warmup", type=int, default=5, help="warm-up iterations per size (default 5)")
    commbench.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    commbench.add_argument(
        "--oversubscribe", action="store_true", help="allow more ranks than CPU cores on this machine"
    )
    commbench.add_argument(
        "--out",
        default="runs/commbench.json",
        help="JSON results; the Markdown table goes next to it as .md (default runs/commbench.json)",
    )
    commbench.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from launchers.commbench import BenchOptions, run_commbench

    options = BenchOptions(
        out=args.out,
        min_bytes=args.min_bytes,
        max_bytes=args.max_bytes,
        iters=args.iters,
        warmup=args.warmup,
        device=args.device,
    )
    return run_commbench(
        options,
        args.nproc_per_node,
        args.nnodes,
        args.node_rank,
        args.master_addr,
        args.master_port,
        args.oversubscribe,
        debug=args.debug,
    )
