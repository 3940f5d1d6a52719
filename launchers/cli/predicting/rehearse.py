"""``kanscale rehearse``."""

from __future__ import annotations

import argparse

from launchers.cli.common import at_least, common_options


def register(subcommands: argparse._SubParsersAction) -> None:
    rehearse = subcommands.add_parser(
        "rehearse",
        parents=[common_options()],
        help="run each strategy's own step at a target's world size, here, in one process per strategy",
        description="Rehearse an experiment at a target's layout (--nnodes x --nproc-per-node ranks) without "
        "its devices: each strategy's own code (the backends kanscale run uses) runs one set-up step and one "
        "counted step here, as one rank of the target, on torch's fake process group (collectives are issued "
        "and counted, nothing is sent). Per rank and step it reports the model state, tensor memory by "
        "category at the peak (torch's MemTracker), every collective with its group and bytes, FLOPs and "
        "kernels; strategies a launch at that layout would refuse are listed with why. Tensors are real "
        "and on this CPU: a rank's share of the model must fit here (docs/rehearsal.md).",
    )
    rehearse.add_argument("config", help="experiment YAML (its strategy section is replaced by each preset)")
    rehearse.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set training.global_batch=4096 (repeatable)",
    )
    rehearse.add_argument("--nnodes", type=at_least(1), default=1, metavar="N", help="nodes (default 1)")
    rehearse.add_argument(
        "--nproc-per-node", type=at_least(1), default=2, metavar="G", help="ranks per node (default 2)"
    )
    rehearse.add_argument("--rank", type=at_least(0), default=0, help="the rank to rehearse as (default 0)")
    rehearse.add_argument(
        "--strategies",
        help="comma-separated presets or preset files (default: every shipped preset)",
    )
    rehearse.add_argument("--json", metavar="FILE", help="also write the results as JSON (.json; Markdown next to it)")
    rehearse.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from launchers.rehearse import RehearsalRequest, run_rehearsal

    fields = {f: getattr(args, f) for f in RehearsalRequest.__dataclass_fields__}
    return run_rehearsal(RehearsalRequest(**fields))
