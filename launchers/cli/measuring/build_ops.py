"""``kanscale build-ops``: build the fused B-spline op ahead of time (``make install`` runs it)."""

from __future__ import annotations

import argparse

from launchers.cli.common import common_options


def register(subcommands: argparse._SubParsersAction) -> None:
    build = subcommands.add_parser(
        "build-ops",
        parents=[common_options()],
        help="build the fused B-spline op (model.impl: fused) now, so that no run compiles it; -v shows the "
        "compiler's commands",
    )
    build.add_argument(
        "--if-possible",
        action="store_true",
        help="where the op cannot be built here, say why and succeed (model.impl auto then runs the fast layer)",
    )
    build.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from kan_models.fused.build import run  # torch: imported only when this command runs

    return run(if_possible=args.if_possible, verbose=(getattr(args, "verbosity", None) or 0) > 0)
