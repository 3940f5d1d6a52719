"""``kanscale bench``."""

from __future__ import annotations

import argparse

from kanscale import log
from kanscale.errors import ConfigError
from launchers.bench_catalog import DEFAULT_IMPLS, DEFAULT_WORKLOADS, IMPLEMENTATIONS, WORKLOADS
from launchers.cli.common import common_options

logger = log.get(__name__)


def register(subcommands: argparse._SubParsersAction) -> None:
    bench = subcommands.add_parser(
        "bench",
        parents=[common_options()],
        help="time and memory of the zoo's implementations on standard workloads",
        description="Measure forward, backward and train-step time, samples/s and "
        "memory of each implementation in one run on this machine; writes "
        "JSON and a Markdown table (see docs/performance.md).",
    )
    workloads = ", ".join(f"{name} ({w.about})" for name, w in WORKLOADS.items())
    bench.add_argument(
        "--models", help=f"comma-separated workloads: {workloads} (default: {','.join(DEFAULT_WORKLOADS)})"
    )
    bench.add_argument(
        "--impl",
        help=f"comma-separated implementations: {', '.join(IMPLEMENTATIONS)}, each optionally "
        "with +compile (the model compiled) or +step (the whole train step compiled: "
        "forward and loss, compiled autograd, the optimizer) (default: "
        f"{', '.join(DEFAULT_IMPLS)})",
    )
    bench.add_argument("--threads", type=int, default=1, help="intra-op CPU threads (default 1, as in the study)")
    bench.add_argument(
        "--repeats",
        type=int,
        help="timed train steps per measurement (default: "
        + ", ".join(f"{name} {w.repeats}" for name, w in WORKLOADS.items())
        + ")",
    )
    bench.add_argument("--device", default="auto", help="auto (CUDA if available), cpu or cuda")
    bench.add_argument(
        "--out",
        default="runs/bench.json",
        help="JSON results; the Markdown table goes next to it with .md (default runs/bench.json)",
    )
    bench.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from analysis.report.documents import json_out, write_json_and_markdown
    from launchers import bench

    try:
        plan = bench.make_plan(args.models, args.impl, args.threads, args.repeats, args.device)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    out = json_out(args.out)
    doc = bench.run(plan, progress=lambda line: logger.info(f"[bench] {line}"))
    table = bench.markdown(doc)
    twin = write_json_and_markdown(out, doc, table)
    print(table)
    logger.info(f"wrote {out} and {twin}")
    return 0
