"""Checkpoints, resume, export and failures, with real ranks: nothing is lost, nothing hangs."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from analysis.records.load import load_runs
from analysis.records.run_files import read_steps, read_summary
from kan_models import build_model, parse_model_config
from launchers.cli import main
from strategies.experiment import parse_experiment
from strategies.lifecycle.checkpoint import complete_checkpoints
from strategies.loop.trainer import Trainer, find_resumable
from strategies.runtime.distributed import DistEnv
from tests.helpers.launch import ROOT, child_env, run_jobs

# The slow tier (make test-slow, run by .ci/run): failing and killed ranks, resumes and sweeps of real runs.
pytestmark = pytest.mark.slow

STRATEGIES = {
    "ddp": {"name": "ddp"},
    "fsdp1": {"name": "fsdp1"},
    "fsdp2": {"name": "fsdp2"},
    "zero0": {"name": "deepspeed", "zero_stage": 0},
    "zero1": {"name": "deepspeed", "zero_stage": 1},
    "zero2": {"name": "deepspeed", "zero_stage": 2},
    "zero3": {"name": "deepspeed", "zero_stage": 3},
    "zero3_offload": {"name": "deepspeed", "zero_stage": 3, "offload_optimizer": True},
    "accelerate": {"name": "accelerate"},
}
MODEL = {"family": "bspline", "widths": [2, 8, 1], "grid": 5, "grid_range": [-2.0, 2.0]}


def experiment(name: str, strategy: dict, out: Path, **training) -> dict:
    return {
        "name": name,
        "model": MODEL,
        "task": {"name": "quadratic", "n_train": 640, "n_test": 64},
        "training": {
            "seed": 1,
            "lr": 0.01,
            "micro_batch": 32,
            "steps": 12,
            "warmup_steps": 1,
            "checkpoint_every": 4,
            **training,
        },
        "strategy": strategy,
        "measurement": {"baseline_steps": 1},
        "runtime": {"device": "cpu", "threads": 1},
        "output": {"dir": str(out)},
    }


def interrupted(config: dict, step: int = 10) -> dict:
    return {**config, "fault": {"rank": "all", "step": step, "kind": "exception"}}


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reliability")
    jobs = []
    for key, strategy in STRATEGIES.items():
        cfg = experiment(f"resume_{key}", strategy, tmp / key)
        jobs += [
            {"id": f"{key}/full", "config": cfg},
            {"id": f"{key}/failed", "config": interrupted(cfg)},
            {"id": f"{key}/resumed", "config": cfg, "resume": True},
        ]
    export_to = tmp / "zero3.pt"
    jobs.append({"id": "export", "export": "zero3/full", "to": str(export_to)})
    for key in ("fsdp2", "ddp"):
        cfg = experiment(
            f"continue_{key}", STRATEGIES[key], tmp / "continued", steps=4, checkpoint_every=0, init_from=str(export_to)
        )
        jobs.append({"id": f"continue/{key}", "config": cfg})
    return tmp, run_jobs(jobs, tmp)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_resumed_run_repeats_the_uninterrupted_losses_bit_for_bit(worker, strategy):
    _, results = worker
    full, failed, resumed = (results[f"{strategy}/{kind}"] for kind in ("full", "failed", "resumed"))
    assert failed["status"] == "raised" and "injected fault" in failed["error"]
    assert resumed["status"] == "ok" and resumed["resumed_at_steps"] == [8]
    assert resumed["losses"] == full["losses"] and len(full["losses"]) == 12
    assert resumed["ranks_identical"]
    # the resumed run continued in the failed run's directory: one record, all 12 steps
    run_dir = Path(resumed["run_dir"])
    assert [s.loss for s in read_steps(run_dir)] == full["losses"]
    assert read_summary(run_dir).status == "ok"


def test_single_process_resume(tmp_path):
    cfg = experiment("resume_single", {"name": "single"}, tmp_path)
    full = Trainer(parse_experiment(cfg), DistEnv(), show_progress=False)
    full.run()
    with pytest.raises(RuntimeError, match="injected fault"):
        Trainer(parse_experiment(interrupted(cfg, step=7)), DistEnv(), show_progress=False).run()
    resumed = Trainer(
        parse_experiment(cfg), DistEnv(), show_progress=False, resume=find_resumable(parse_experiment(cfg), 1)
    )
    record = resumed.run()
    assert record.resumed_at_steps == [4]
    assert [s.loss for s in resumed.combined] == [s.loss for s in full.combined]


def test_only_complete_checkpoints_are_kept_and_they_are_atomic(worker):
    _tmp, results = worker
    run_dir = Path(results["ddp/full"]["run_dir"])
    assert [c.step for c in complete_checkpoints(run_dir)] == [8, 12]  # keep_checkpoints = 2
    torn = run_dir / "checkpoints" / "step-000016.tmp"  # a save that died half-way
    torn.mkdir()
    assert [c.step for c in complete_checkpoints(run_dir)] == [8, 12]


def loss_of(state: dict, batch_x: torch.Tensor, batch_y: torch.Tensor) -> float:
    model = build_model(parse_model_config(MODEL), seed=0)
    model.load_state_dict(state)
    with torch.no_grad():
        return float(((model(batch_x) - batch_y) ** 2).mean())


@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_a_zero3_checkpoint_exported_continues_under_another_strategy(worker, strategy):
    tmp, results = worker
    exported = torch.load(tmp / "zero3.pt", weights_only=False)
    assert exported["source"]["format"] == "deepspeed" and exported["source"]["step"] == 12
    cfg = parse_experiment(experiment("x", STRATEGIES[strategy], tmp, steps=4))
    data = cfg.task.generate(cfg.training.seed)
    from strategies.runtime.batch_plan import BatchPlan

    first = BatchPlan(640, 64, cfg.training.seed, steps=4).global_indices(0)
    expected = loss_of(exported["model_state"], data.x_train[first].float(), data.y_train[first].float())
    continued = results[f"continue/{strategy}"]["losses"]
    assert continued[0] == pytest.approx(expected, rel=1e-5)  # starts exactly where ZeRO-3 stopped
    assert continued[0] < 0.8 * results["zero3/full"]["losses"][0]  # not a fresh start
    assert continued[-1] < continued[0]


def test_export_refuses_what_is_not_a_checkpoint(tmp_path, capsys):
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "m.pt")]) == 2
    assert "no complete checkpoint here" in capsys.readouterr().err


# ------------------------------------------------------------------------------- failures

QUICK = [
    sys.executable,
    "-m",
    "launchers.cli",
    "run",
    str(ROOT / "configs/experiments/quickstart.yaml"),
    "--strategy",
    "ddp",
    "--nproc-per-node",
    "2",
    "--set",
    "training.steps=20",
    "--set",
    "training.micro_batch=64",
    "--set",
    "measurement.baseline_steps=1",
    "--set",
    "runtime.timeout_s=5",
    "--set",
    "training.log_every=1",
]


@pytest.mark.parametrize("kind,error_type", [("exception", "RuntimeError"), ("exit", "RankLost"), ("hang", "RankHung")])
def test_a_failing_rank_ends_the_run_in_bounded_time_with_a_record(tmp_path, kind, error_type):
    start = time.monotonic()
    proc = subprocess.run(
        [
            *QUICK,
            "--out",
            str(tmp_path),
            "--set",
            "fault.rank=1",
            "--set",
            "fault.step=6",
            "--set",
            f"fault.kind={kind}",
        ],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert elapsed < 120, f"took {elapsed:.0f} s"  # start-up + runtime.timeout_s + the launcher's grace period
    (run_dir,) = list(tmp_path.iterdir())
    record = read_summary(run_dir)
    assert record.status == "failed"
    assert (record.error.type, record.error.rank, record.error.step) == (error_type, 1, 5)
    assert [s.step for s in read_steps(run_dir)] == [1, 2, 3, 4, 5]  # what was written stays readable


def test_a_killed_run_reads_as_incomplete(tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launchers.cli",
            "train",
            str(ROOT / "configs/experiments/quickstart.yaml"),
            "--out",
            str(tmp_path),
            "--no-progress",
            "--set",
            "training.steps=100000",
            "--set",
            "training.log_every=5",
        ],
        cwd=ROOT,
        env=child_env(),
        stderr=subprocess.DEVNULL,
    )

    def written() -> int:
        return sum(len(p.read_text().splitlines()) for p in tmp_path.glob("*/steps.jsonl"))

    deadline = time.monotonic() + 120
    while written() < 5:  # the first write (log_every): a kill now leaves steps to read back
        assert proc.poll() is None and time.monotonic() < deadline, "the run wrote no steps"
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    (run_dir,) = list(tmp_path.iterdir())
    assert read_summary(run_dir).status == "incomplete"
    assert len(read_steps(run_dir)) >= 5
    runs, problems = load_runs(tmp_path)
    assert problems == [] and list(runs["status"]) == ["incomplete"]


def test_a_diverging_loss_stops_the_run(tmp_path, capsys):
    code = main(
        [
            "train",
            str(ROOT / "configs/experiments/quickstart.yaml"),
            "--out",
            str(tmp_path),
            "--no-progress",
            "--set",
            "training.steps=30",
            "--set",
            "training.optimizer=sgd",
            "--set",
            "training.lr=1e8",
        ]
    )
    assert code == 1
    assert "NonFiniteLoss: the training loss became" in capsys.readouterr().err
    (run_dir,) = list(tmp_path.iterdir())
    record = read_summary(run_dir)
    assert record.status == "failed" and record.error.type == "NonFiniteLoss" and record.error.step < 30


def test_a_sweep_resumes_an_interrupted_point_from_its_checkpoint(tmp_path, capsys):
    def study(fault: bool) -> Path:
        path = tmp_path / "study.yaml"
        settings = {
            "training.steps": 12,
            "training.checkpoint_every": 4,
            "training.micro_batch": 64,
            "measurement.baseline_steps": 1,
        }
        if fault:
            settings.update({"fault.rank": "all", "fault.step": 10})
        path.write_text(
            yaml.safe_dump(
                {
                    "study": "interrupted",
                    "experiment": str(ROOT / "configs/experiments/quickstart.yaml"),
                    "set": settings,
                    "matrix": {"strategy": ["ddp"], "topology": ["1x2"]},
                }
            )
        )
        return path

    out = tmp_path / "runs"
    assert main(["sweep", str(study(fault=True)), "--out", str(out)]) == 1
    assert main(["sweep", str(study(fault=False)), "--out", str(out), "--resume"]) == 0
    assert "1 ok" in capsys.readouterr().out
    (run_dir,) = list(out.glob("*/summary.json"))
    record = read_summary(run_dir.parent)
    assert record.status == "ok" and record.resumed_at_steps == [8] and len(read_steps(run_dir.parent)) == 12
    statuses = [json.loads(line)["status"] for line in (out / "sweep.jsonl").read_text().splitlines()]
    assert statuses == ["failed", "ok"]


def test_a_second_sigterm_does_not_cut_the_failure_report_short(tmp_path):
    """Launchers often signal a rank twice (slurmstepd and the deepspeed launcher, milliseconds
    apart): the first SIGTERM becomes Terminated, and the report it triggers must still finish."""
    done = tmp_path / "reported"
    # The report waits for a line on stdin, which the test sends after the second SIGTERM, so
    # that signal arrives while the report is being written.
    script = (
        "import sys, time\nfrom strategies.lifecycle.failures import Terminated, raise_on_sigterm\nraise_on_sigterm()\n"
        "try:\n    print('ready', flush=True)\n    time.sleep(60)\nexcept Terminated:\n"
        "    print('reporting', flush=True)\n    sys.stdin.readline()\n"
        f"    open({str(done)!r}, 'w').write('done')\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.readline().strip() == "reporting"
    proc.send_signal(signal.SIGTERM)
    proc.communicate("go on\n", timeout=30)
    assert done.read_text() == "done"
