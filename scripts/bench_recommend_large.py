"""How long ``kanscale recommend`` takes, and how much of this machine's memory, for a model of
about 358M parameters on the published study's cluster (configs/clusters/a100_ib.yaml, 4 nodes x
2 GPUs): the targets are 2 minutes and 2 GiB (docs/recommend.md). Runs the command as a user
would, in a child process, and prints its wall time and the largest resident set of it and the
processes it started, each against its target.

    python scripts/bench_recommend_large.py
    python scripts/bench_recommend_large.py --strategies ddp,zero3
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LARGE = ["model.widths=[64,4096,4096,1]", "model.grid=16", "model.grid_range=[-1,1]", "task.name=high_dim"]
LARGE.append("task.dim=64")
TARGET_S, TARGET_BYTES = 120.0, 2 * 2**30


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", help="comma-separated presets (default: every one recommend considers)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-recommend-") as out:
        command = [sys.executable, "-m", "launchers.cli", "recommend", "configs/experiments/quickstart.yaml"]
        command += [f for o in LARGE for f in ("--set", o)]
        command += ["--cluster", "configs/clusters/a100_ib.yaml", "--nnodes", "4", "--nproc-per-node", "2"]
        command += ["--global-batch", "512", "--out", out]
        command += ["--strategies", args.strategies] if args.strategies else []
        started = time.perf_counter()
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - started
    if proc.returncode:
        print(proc.stderr[-3000:], file=sys.stderr)
        return proc.returncode
    # the largest resident set of any child this process waited for (Linux: kilobytes)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    trainable = next((line for line in proc.stdout.splitlines() if "trainable parameters;" in line), "?")
    derived = proc.stdout.count("derived, not rehearsed")
    print(f"model: {trainable.split(';')[0]}")
    print(f"strategies derived, not rehearsed (a rank too large to hold here): {derived}")
    print(f"wall time: {wall:.1f} s, {wall / TARGET_S:.2f} of the {TARGET_S:.0f} s target")
    print(f"largest resident set: {peak / 2**20:.0f} MiB, {peak / TARGET_BYTES:.2f} of the 2 GiB target")
    return 0 if wall <= TARGET_S and peak <= TARGET_BYTES else 1


if __name__ == "__main__":
    sys.exit(main())
