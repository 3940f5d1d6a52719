"""``kanscale recommend``."""

from __future__ import annotations

import argparse

from launchers.cli.common import at_least, common_options


def byte_count(text: str) -> float:
    """An argparse type: bytes, plain or with a binary unit (40GiB, 512MiB)."""
    units = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "B": 1}
    for unit, factor in units.items():
        if text.endswith(unit):
            number, scale = text[: -len(unit)], factor
            break
    else:
        number, scale = text, 1
    try:
        value = float(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a byte count; give e.g. 40GiB, 512MiB or 1073741824"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive byte count, e.g. 40GiB")
    return value


def register(subcommands: argparse._SubParsersAction) -> None:
    recommend = subcommands.add_parser(
        "recommend",
        parents=[common_options()],
        help="which strategy, layout and micro-batch to train with: predicted, explained, optionally validated",
        description="Rank every strategy for an experiment's model on a target (a cluster file, or this machine): "
        "which fit in each rank's memory at which micro-batch, their predicted samples/s with an interval, "
        "memory per rank and headroom, why each ranks where it does, and the kanscale run command for "
        "the pick. For a GPU cluster file each candidate's own step is rehearsed at the target's layout (nothing "
        "trained; its kernels costed on the cluster's devices); for this machine it measures first: each "
        "candidate trains 5 steps on one rank (under OUT/probe), and without --network this machine's links "
        "are measured with kanscale commbench. "
        "Everything it predicts is labelled so, with its assumptions (docs/recommend.md).",
    )
    recommend.add_argument(
        "config", help="experiment YAML (its model, task and training; the strategy section is ignored)"
    )
    recommend.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set model.widths=[8,256,256,1] (repeatable)",
    )
    links = recommend.add_mutually_exclusive_group()
    links.add_argument(
        "--cluster",
        metavar="FILE",
        help="the target: a cluster file with links, ranks_per_node and "
        "device_memory_GiB (e.g. configs/clusters/a100_ib.yaml); "
        "default: this machine",
    )
    links.add_argument(
        "--network",
        action="append",
        metavar="COMMBENCH_JSON",
        help="this machine's links from kanscale commbench results (default: measured now)",
    )
    recommend.add_argument(
        "--nproc-per-node", type=at_least(1), metavar="G", help="ranks per node (default: the cluster file's, else 2)"
    )
    recommend.add_argument("--nnodes", type=at_least(1), metavar="N", help="nodes (default 1)")
    recommend.add_argument(
        "--global-batch",
        type=at_least(1),
        metavar="B",
        help="samples per optimizer step over all ranks (default: the experiment's)",
    )
    recommend.add_argument(
        "--memory-per-device",
        type=byte_count,
        metavar="BYTES",
        help="memory of one rank's device, e.g. 80GiB (default: the cluster file's "
        "device_memory_GiB, else this machine's RAM over its ranks)",
    )
    recommend.add_argument(
        "--strategies",
        help="comma-separated presets or preset files to consider (default: every "
        "shipped preset the projection models)",
    )
    recommend.add_argument(
        "--contention",
        type=float,
        default=None,
        help="this machine: multiply compute by this when ranks share its cores (default: as kanscale "
        "commbench measured it here, at the step's compute length)",
    )
    recommend.add_argument(
        "--validate",
        type=at_least(0),
        default=0,
        metavar="K",
        help="then train the top K picks and the predicted worst here, and print predicted against measured",
    )
    recommend.add_argument(
        "--json", metavar="FILE", help="also write the recommendation as JSON (.json; Markdown next to it)"
    )
    recommend.add_argument(
        "--out",
        default="runs/recommend",
        help="where the probes, measured links and validation runs go (default runs/recommend)",
    )
    recommend.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from launchers.recommend.advise import RecommendRequest
    from launchers.recommend.report import run_recommend

    fields = {f: getattr(args, f) for f in RecommendRequest.__dataclass_fields__}
    return run_recommend(RecommendRequest(**fields))
