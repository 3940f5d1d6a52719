"""Short real runs of every CPU strategy whose records the projection's and the rehearsal's
figures are checked against: one 2-rank launch for every distributed strategy under fp32 and
bf16, single in the test's own process."""

from pathlib import Path

from analysis.records.run_files import SUMMARY_FILE, read_summary
from tests.helpers.launch import run_here, run_jobs
from tests.helpers.parity import STRATEGIES, experiment

PRECISIONS = ("fp32", "bf16")
DISTRIBUTED = ["ddp", "fsdp1", "fsdp2", "zero0", "zero1", "zero2", "zero3", "zero3_offload"]
SHORT = {"steps": 2, "warmup_steps": 1}


def state_experiment(strategy: str, out: Path, precision: str) -> dict:
    section = {"name": "single"} if strategy == "single" else STRATEGIES[strategy]
    return experiment("bspline", section, 1, str(out), precision=precision, **SHORT)


def run_state_runs(tmp: Path) -> dict[tuple[str, str], dict]:
    """What each run recorded (model_state, comm_bytes), by (precision, strategy)."""
    jobs = [{"id": f"{p}/{k}", "config": state_experiment(k, tmp / "r", p)} for p in PRECISIONS for k in DISTRIBUTED]
    results = run_jobs(jobs, tmp)
    runs = {(p, k): results[f"{p}/{k}"] for p in PRECISIONS for k in DISTRIBUTED}
    for p in PRECISIONS:
        trainer = run_here(state_experiment("single", tmp / "s", p))
        record = read_summary(trainer.run_dir / SUMMARY_FILE)
        runs[p, "single"] = {"model_state": record.memory.model_state.model_dump(), "comm_bytes": None}
    return runs
