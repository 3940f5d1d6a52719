"""``kanscale project``."""

from __future__ import annotations

import argparse

from launchers.cli.common import common_options


def register(subcommands: argparse._SubParsersAction) -> None:
    project = subcommands.add_parser(
        "project",
        parents=[common_options()],
        help="projected scaling of every strategy: step time, efficiency, exposed communication, memory",
        description="Project, per strategy and rank count, step time, speedup, parallel efficiency, "
        "exposed communication and per-rank model-state bytes from a measured compute "
        "profile and a network (kanscale commbench results or a cluster file). Everything "
        "it prints is a projection, labelled so, with its assumptions (docs/projection.md).",
    )
    project.add_argument(
        "--profile",
        required=True,
        metavar="RUNS|BENCH_JSON|paper",
        help="1-rank run(s) of one experiment (a run directory or a directory of runs), a kanscale bench "
        "JSON, or paper (the published study's 1-GPU run)",
    )
    project.add_argument("--row", metavar="WORKLOAD/IMPL", help="the row of a bench JSON, e.g. study/fast")
    network = project.add_mutually_exclusive_group(required=True)
    network.add_argument(
        "--network",
        action="append",
        metavar="COMMBENCH_JSON",
        help="kanscale commbench results (repeatable: one intra-node, one inter-node)",
    )
    network.add_argument("--cluster", metavar="YAML", help="a cluster description, e.g. configs/clusters/a100_ib.yaml")
    project.add_argument("--ranks", default="1,2,4,8", help="comma-separated rank counts (default 1,2,4,8)")
    project.add_argument("--ranks-per-node", type=int, metavar="G", help="ranks per node (default: the network's)")
    project.add_argument(
        "--strategies",
        help="comma-separated strategy presets, shipped (their names are the labels) "
        "or YAML files of your own (default: every shipped preset the projection "
        "models: single, ddp, fsdp1, fsdp1_hybrid, fsdp2, hsdp, fsdp2_tp, tp, zero0-3, "
        "zero3_offload); "
        "each strategy class describes what it issues per step",
    )
    per_step = project.add_mutually_exclusive_group()
    per_step.add_argument(
        "--micro-batch",
        type=float,
        help="samples per rank per step, per model replica under tp and fsdp2_tp (default: the profile's)",
    )
    per_step.add_argument("--global-batch", type=float, help="samples per step over all ranks, fixed (strong scaling)")
    project.add_argument(
        "--compute-scale",
        type=float,
        default=1.0,
        help="multiply every compute time, e.g. for another device (default 1)",
    )
    project.add_argument(
        "--contention",
        type=float,
        default=1.0,
        help="multiply compute by this when P > 1: ranks slowing each other, e.g. sharing CPU cores (default 1)",
    )
    project.add_argument(
        "--forward-fraction",
        type=float,
        help="forward's share of the profile's compute (default: measured by bench, else 1/3)",
    )
    project.add_argument("--probe", action="store_true", help="add the published study's communication probe")
    project.add_argument("--out", help="also write JSON here, a .json file (and the Markdown next to it as .md)")
    project.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from launchers.project import ProjectionRequest, run_projection

    fields = {f: getattr(args, f) for f in ProjectionRequest.__dataclass_fields__}
    return run_projection(ProjectionRequest(**fields))
