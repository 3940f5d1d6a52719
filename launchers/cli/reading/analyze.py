"""``kanscale analyze``."""

from __future__ import annotations

import argparse
from pathlib import Path

from kanscale import log
from kanscale.directories import check_output_dir, runs_directory
from launchers.cli.common import common_options

logger = log.get(__name__)


def register(subcommands: argparse._SubParsersAction) -> None:
    analyze = subcommands.add_parser(
        "analyze",
        parents=[common_options()],
        help="turn a directory of runs into tables, plots and an HTML report",
        description="Load every run record under DIR, derive speedup, efficiency, retention, "
        "communication overhead and memory per rank, and write CSV and Markdown tables per "
        "study, a cross-strategy comparison, PNG plots and one self-contained HTML report.",
    )
    analyze.add_argument("runs", metavar="DIR", help="directory holding run records (searched recursively)")
    analyze.add_argument("--out", metavar="REPORT_DIR", help="where to write the report (default: DIR/report)")
    analyze.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Exit 0 with a report (one that says so when DIR holds no records); a DIR that does not
    exist, or a report directory that cannot be written, is a ConfigError (exit 2) and nothing
    is written."""
    runs_directory(args.runs)  # before the seconds of importing pandas and matplotlib
    check_output_dir(
        args.out or Path(args.runs) / "report",
        "--out" if args.out else "--out (not given: DIR/report)",
        "to write the report in (--out REPORT_DIR)",
    )
    from analysis.report.analyze import analyze, summary_line

    report = analyze(args.runs, args.out)
    if report.verdict is not None:
        print(report.verdict.markdown())
    for problem in report.problems:
        logger.info(f"not analysed: {problem.message}")
    for _, row in report.unfinished.iterrows():
        logger.info(f"not analysed: {row['run_id']} has status {row['status']}")
    if report.finished == 0:
        logger.warning(summary_line(report, Path(args.runs)))
    print(f"report: {report.html}")
    return 0
