"""``kanscale analyze``."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import TYPE_CHECKING

from analysis.projection.cluster_file import check_cluster
from kanscale import log
from kanscale.directories import check_output_dir, runs_directory
from kanscale.errors import ConfigError
from kanscale.files import find_file, read_mapping
from launchers.cli.common import common_options

if TYPE_CHECKING:
    from analysis.report.analyze import PeakRate

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
    peak = analyze.add_mutually_exclusive_group()
    peak.add_argument(
        "--peak-tflops",
        metavar="TFLOPS|gemm",
        help="one rank's peak rate, for model FLOPs utilisation (MFU) in the tables: TFLOP/s (a GPU's "
        "datasheet figure for the runs' precision, e.g. 989 for an H100's bf16), or gemm: this "
        "machine's dense float32 matrix-product rate, measured now on the threads the runs' ranks had "
        "(CPU runs). Without it (or --cluster) the tables give achieved FLOP/s and no MFU",
    )
    peak.add_argument(
        "--cluster",
        metavar="FILE",
        help="a cluster file (configs/clusters/) whose device_tflops is one rank's rate, for MFU",
    )
    analyze.add_argument(
        "--memory-budget",
        metavar="GIB",
        type=float,
        default=80.0,
        help="memory per rank, in GiB, for which the memory budget table gives the largest micro-batch "
        "each strategy fits without and with activation checkpointing (runs at two micro-batches or "
        "more, e.g. the activation_memory study; default: 80)",
    )
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
    peak = peak_rate(args)
    if not (math.isfinite(args.memory_budget) and args.memory_budget > 0):
        raise ConfigError(
            f"--memory-budget is {args.memory_budget:g}; give the memory of one rank in GiB as a positive number, "
            "e.g. --memory-budget 80"
        )
    from analysis.report.analyze import analyze, summary_line

    report = analyze(args.runs, args.out, peak, args.memory_budget * 2**30)
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


def peak_rate(args: argparse.Namespace) -> PeakRate | None:
    """--peak-tflops or --cluster as one rank's peak rate, checked before any record is read."""
    if args.cluster:
        path = find_file(args.cluster, "--cluster", "cluster file")
        doc = read_mapping(path, "--cluster")
        check_cluster(doc, path, needs={"device_tflops"})
        tflops = float(doc["device_tflops"])
        return lambda _threads: (tflops * 1e12, f"{tflops:g} TFLOP/s, device_tflops of {path}")
    if args.peak_tflops is None:
        return None
    if args.peak_tflops == "gemm":
        return measured_gemm_rate
    try:
        tflops = float(args.peak_tflops)
    except ValueError:
        tflops = math.nan
    if not (math.isfinite(tflops) and tflops > 0):
        raise ConfigError(
            f"--peak-tflops is {args.peak_tflops!r}; give one rank's peak in TFLOP/s as a positive number "
            "(e.g. --peak-tflops 989), or --peak-tflops gemm to measure this machine's"
        )
    return lambda _threads: (tflops * 1e12, f"{tflops:g} TFLOP/s (--peak-tflops)")


def measured_gemm_rate(threads: int) -> tuple[float, str]:
    """This machine's dense float32 GEMM rate on ``threads`` threads, measured now."""
    import torch

    from launchers.bench import gemm_rate

    torch.set_num_threads(threads)
    rate = gemm_rate(torch.device("cpu"))
    logger.info(f"dense float32 GEMM rate: {rate / 1e9:,.1f} GFLOP/s on {threads} thread(s) (--peak-tflops gemm)")
    return rate, f"this machine's dense float32 GEMM rate on {threads} thread(s), {rate / 1e9:,.1f} GFLOP/s, measured"
