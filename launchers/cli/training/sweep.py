"""``kanscale sweep``."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from kanscale import log
from launchers.cli.common import common_options

logger = log.get(__name__)


def register(subcommands: argparse._SubParsersAction) -> None:
    sweep = subcommands.add_parser(
        "sweep",
        parents=[common_options()],
        help="run every point of a study (configs/studies/*.yaml)",
        description="Run every point of a study, one launch each, with a progress bar; a failed point "
        "is recorded and the sweep goes on. Studies whose launcher is slurm write one "
        "sbatch script per point instead.",
    )
    sweep.add_argument("study", help="study YAML, e.g. configs/studies/strong_cpu.yaml")
    sweep.add_argument("--out", required=True, help="directory for the runs (and logs/, sweep.jsonl)")
    sweep.add_argument(
        "--resume", action="store_true", help="skip points whose run record in OUT is complete for the same config"
    )
    sweep.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="AXIS=VALUE",
        help="run only matching points, e.g. --only strategy=zero3 --only topology=1x2 (repeatable)",
    )
    sweep.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        dest="overrides",
        help="override a config field in every point, after the study's own set: and axes, e.g. "
        "--set training.steps=20 to try a study quickly (repeatable; the runs record it)",
    )
    sweep.add_argument("--dry-run", action="store_true", help="print every point's commands, run nothing")
    sweep.add_argument("--submit", action="store_true", help="slurm studies: submit each script with sbatch")
    sweep.add_argument(
        "--wait",
        action="store_true",
        help="with --submit: follow the jobs (squeue, sacct, scontrol) until "
        "each has ended and log every point's final status",
    )
    sweep.add_argument(
        "--oversubscribe",
        action="store_true",
        help="allow points with more ranks than CPU cores here (their memory means something, their timings do not)",
    )
    sweep.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Exit 0 when every point ran or was skipped, 1 when one failed or was stopped, 2 for a study
    refused before any point ran, 128 + the signal's number (143 for SIGTERM, 130 for Ctrl-C)
    when the sweep itself was stopped."""
    from analysis.records.load import load_runs
    from analysis.report.tables import markdown, quick_comparison
    from launchers.studies.point import SweepStopped, stop_signal
    from launchers.studies.sweep import run_sweep
    from strategies.lifecycle.failures import Terminated

    try:
        results = run_sweep(
            args.study,
            args.out,
            resume=args.resume,
            dry_run=args.dry_run,
            only=args.only,
            submit_jobs=args.submit,
            wait=args.wait,
            oversubscribe=args.oversubscribe,
            overrides=args.overrides,
        )
    except (SweepStopped, Terminated, KeyboardInterrupt) as err:
        where = (
            f" during {err.result.point} (logged in {Path(args.out) / 'sweep.jsonl'})"
            if isinstance(err, SweepStopped)
            else ""
        )
        stop = stop_signal(err)
        again = [
            "kanscale",
            "sweep",
            args.study,
            "--out",
            args.out,
            "--resume",
            *(f for o in args.only for f in ("--only", o)),
            *(f for o in args.overrides for f in ("--set", o)),
            *(
                flag
                for flag, on in (
                    ("--submit", args.submit),
                    ("--wait", args.wait),
                    ("--oversubscribe", args.oversubscribe),
                )
                if on
            ),
        ]
        logger.warning(f"sweep: stopped by {stop.name}{where}; continue the study with: {shlex.join(again)}")
        return 128 + stop
    if args.dry_run:  # a point that cannot be planned has said why (launchers.studies.sweep)
        return 1 if any(r.status == "failed" for r in results) else 0
    counts = {status: sum(r.status == status for r in results) for status in dict.fromkeys(r.status for r in results)}
    print("\nsweep: " + ", ".join(f"{n} {status}" for status, n in counts.items()))
    for r in results:
        if r.status in ("failed", "stopped"):
            print(f"  {r.status}: {r.point}: {r.detail}")
    run_ids = {r.run_id for r in results if r.run_id}
    runs, _ = load_runs(args.out)
    # Only finished runs have the table's figures: a sweep whose every run failed or stopped has none to show.
    finished = runs[runs["run_id"].isin(run_ids) & (runs["status"] == "ok")] if not runs.empty else runs
    if not finished.empty:
        print("\n" + markdown(quick_comparison(finished)))
    written = [r for r in results if r.status in ("written", "submitted")]
    if written:
        advice = "" if args.submit else "; submit each with sbatch, or rerun with --submit"
        advice = advice if args.wait or not args.submit else "; follow them with --resume --submit --wait"
        print(f"\n{len(written)} sbatch script(s) under {Path(args.out) / 'slurm'}{advice}")
    print(f"\nnext: kanscale analyze {shlex.quote(args.out)}")
    return 1 if counts.get("failed") or counts.get("stopped") else 0
