"""``kanscale compare-paper``."""

from __future__ import annotations

import argparse

from kanscale import log
from launchers.cli.common import common_options

logger = log.get(__name__)


def register(subcommands: argparse._SubParsersAction) -> None:
    paper = subcommands.add_parser(
        "compare-paper", parents=[common_options()], help="the published study's numbers beside your runs of its setup"
    )
    paper.add_argument("runs", metavar="DIR", help="directory holding run records")
    paper.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from analysis.records.load import load_runs
    from analysis.report.derive import derive
    from analysis.report.paper import paper_comparison, probe_costs

    runs, problems = load_runs(args.runs)
    derived = derive(runs) if not runs.empty else runs
    if derived.empty:
        print("no finished runs to compare")
    else:
        print(paper_comparison(derived).markdown())
        probe = probe_costs(derived, problems)
        if probe is not None:
            print("\n" + probe.markdown())
    for problem in problems:
        logger.info(f"not analysed: {problem.message}")
    return 0
