"""``kanscale``: one module per subcommand, each with ``register`` (its parser) and ``main``,
grouped by what they do: training, measuring, predicting, reading."""

from __future__ import annotations

import argparse
import sys

from kanscale import __version__, log
from launchers.cli.common import Parser, add_verbosity_options, check_paths, exit_code
from launchers.cli.measuring import bench, build_ops, commbench
from launchers.cli.predicting import project, recommend, rehearse
from launchers.cli.reading import analyze, compare_paper, models, schema
from launchers.cli.training import export, run, sweep, train

SUBCOMMANDS = (
    train,
    run,
    sweep,
    analyze,
    compare_paper,
    export,
    commbench,
    project,
    recommend,
    rehearse,
    models,
    schema,
    bench,
    build_ops,
)

EPILOG = """examples:
  kanscale train quickstart
  kanscale run quickstart --strategy ddp --nproc-per-node 2 -q
  kanscale train configs/experiments/paper_kan64.yaml --set training.epochs=1 --out runs/paper
  torchrun --standalone --nproc_per_node 2 -m launchers.cli train quickstart --strategy fsdp2
  kanscale run quickstart --strategy zero3 --nproc-per-node 2
  kanscale run paper_kan64 --launcher slurm --nnodes 4 --nproc-per-node 2 --dry-run
  kanscale sweep configs/studies/strong_cpu.yaml --out runs/strong
  kanscale analyze runs/strong
  kanscale recommend quickstart --nproc-per-node 2
  kanscale models --widths 2,64,1
  kanscale schema > run_record.schema.json
"""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="kanscale",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train Kolmogorov-Arnold Networks under interchangeable parallelism strategies and "
        "compare what each costs in time, communication and memory.",
    )
    parser.add_argument("--version", action="version", version=f"kanscale {__version__}")
    parser.add_argument("--debug", action="store_true", help="show Python tracebacks on errors")
    add_verbosity_options(parser, default=None)
    # The deepspeed launcher passes --local_rank=N before the subcommand; the rank comes from the
    # environment (LOCAL_RANK), which every launcher sets, so the flag is accepted and ignored.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.register(subcommands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.typed = list(sys.argv[1:] if argv is None else argv)  # what error messages may quote, bounded
    log.configure(args.verbosity)  # None: as the environment says (a rank: as its launcher was told)
    try:
        check_paths(args)
        return args.func(args)
    except BaseException as err:
        return exit_code(err, args)


if __name__ == "__main__":
    sys.exit(main())
