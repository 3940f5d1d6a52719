"""``kanscale train``."""

from __future__ import annotations

import argparse
from pathlib import Path

from launchers.cli.common import add_experiment_options, common_options, experiment_overrides, run_rank


def register(subcommands: argparse._SubParsersAction) -> None:
    train = subcommands.add_parser(
        "train",
        parents=[common_options()],
        help="train one experiment in this process (one rank of a launch)",
        description="Train one experiment. Run it directly for one process, or under "
        "torchrun / accelerate launch / deepspeed for several ranks: every rank "
        "runs this same command and rank 0 writes the run record.",
    )
    train.add_argument("config", help="experiment YAML, e.g. configs/experiments/quickstart.yaml")
    add_experiment_options(train)
    train.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        metavar="RUN_DIR",
        help="continue an unfinished run from its latest complete checkpoint (training.checkpoint_every): "
        "the given run directory, or the newest resumable run of this experiment in output.dir",
    )
    bar = train.add_mutually_exclusive_group()
    bar.add_argument(
        "--progress", dest="progress", action="store_true", default=None, help="always show a progress bar"
    )
    bar.add_argument("--no-progress", dest="progress", action="store_false", help="log lines instead of a progress bar")
    train.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from launchers.summary import format_summary
    from strategies.experiment import load_experiment
    from strategies.loop.trainer import train
    from strategies.runtime.distributed import DistEnv

    settings = {"output.dir": args.out} if args.out else None  # a path as typed, never read as YAML
    cfg = load_experiment(args.config, experiment_overrides(args), strategy=args.strategy, settings=settings)
    env = DistEnv.from_environ(cfg.runtime.device)

    def work() -> int:
        result = train(
            cfg,
            env,
            show_progress=args.progress,
            resume=args.resume if args.resume is True else (Path(args.resume) if args.resume else False),
        )
        if result.is_main:
            print(format_summary(result.record, result.run_dir))
        return 0

    return run_rank(env, args, work)
