"""Each finished run under a folder beside what ``kanscale recommend`` predicts for it on a cluster
file's devices: its strategy rehearsed at the run's layout (docs/rehearsal.md), its kernels costed
on the device, its collectives on the links (docs/recommend.md). A run on a GPU so checks the
model directly; scripts/gpu_checks.sh calls this on its runs with the cluster file of the GPU it
was lent. Prints one Markdown row per run: measured and predicted samples/s with their ratio, and
peak device memory and model state per rank, measured and predicted.

    python scripts/predicted_beside_measured.py gpu_checks/runs --cluster configs/clusters/h100_one_node.yaml
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis.records.run_files import CONFIG_FILE, SUMMARY_FILE, read_summary
from analysis.records.schema import RunRecord
from analysis.report.format import human_bytes
from kanscale.errors import ConfigError
from launchers.recommend.advise import RecommendRequest, recommend

HEADER = (
    "| run | strategy | ranks | measured samples/s | predicted [interval] | predicted / measured | bound (predicted) "
    "| peak / rank measured | predicted | model state / rank measured | predicted |\n"
    "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|"
)


def row(record: RunRecord, run_dir: Path, cluster: str, out: Path) -> str:
    t = record.topology
    r = RecommendRequest(
        str(run_dir / CONFIG_FILE),
        ["runtime.device=cpu"],  # the rehearsal runs here; the device is the cluster file's
        cluster=cluster,
        nnodes=t.nodes,
        nproc_per_node=t.procs_per_node,
        global_batch=record.batch.global_batch,
        strategies=record.strategy.label,
        out=str(out),
    )
    name = f"{run_dir.parent.name}/{run_dir.name}"
    try:
        rec = recommend(r)
    except ConfigError as err:
        return f"| {name} | {record.strategy.label} | {t.world_size} | - | not predicted: {str(err)[:200]} |||||||"
    c = rec.candidates[0]
    measured = record.throughput.samples_per_s if record.throughput else 0.0
    memory = record.memory
    state = sum(memory.model_state.model_dump().values()) if memory else 0
    peak = human_bytes(memory.peak_device_bytes) if memory and memory.peak_device_bytes else "- (no device)"
    ratio = f"{c.samples_per_s / measured:.2f}" if measured else "-"
    return (
        f"| {name} | {c.strategy} | {t.world_size} | {measured:,.0f} | {c.samples_per_s:,.0f} "
        f"[{c.samples_per_s_low:,.0f}-{c.samples_per_s_high:,.0f}] | {ratio} | {c.bound_words} | {peak} "
        f"| {human_bytes(c.peak.total)} | {human_bytes(state)} | {human_bytes(c.peak.model_state)} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, help="a folder of runs (each with summary.json and config.yaml)")
    parser.add_argument("--cluster", required=True, help="the cluster file of the devices the runs ran on")
    parser.add_argument("--out", type=Path, default=Path("runs/predicted"), help="recommend's working folder")
    args = parser.parse_args()
    rows = []
    for summary in sorted(args.runs.rglob(SUMMARY_FILE)):
        record = read_summary(summary)
        if record.status == "ok" and (summary.parent / CONFIG_FILE).is_file():
            rows.append(row(record, summary.parent, args.cluster, args.out))
    if not rows:
        print(f"{args.runs}: no finished run with its config.yaml", file=sys.stderr)
        return 1
    print("Predicted (kanscale recommend, rehearsed here) beside measured:\n")
    print(HEADER)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
