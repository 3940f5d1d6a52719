"""State that must not be lost or corrupted: a finished run is never resumed, a corrupt checkpoint
is found before anything changes and an older one is used, and one permission policy (the umask)
covers every file. A run directory's one owner at a time is tests/test_run_lock.py."""

import json
import sys
from pathlib import Path

import pytest
import yaml

from analysis.records.run_files import read_summary
from kanscale.errors import ConfigError
from launchers.cli import main
from strategies.experiment import parse_experiment
from strategies.lifecycle.checkpoint import complete_checkpoints
from strategies.lifecycle.run_lock import LOCK_FILE
from strategies.loop.trainer import Trainer, find_resumable
from strategies.runtime.distributed import DistEnv
from tests.helpers.launch import ROOT, run, run_here, run_jobs
from tests.helpers.runs import failed_run, failing, losses, small

# The slow tier (make test-slow, run by .ci/run): kills, resumes and concurrent owners of real
# multi-process runs.
pytestmark = pytest.mark.slow

QUICKSTART = str(ROOT / "configs/experiments/quickstart.yaml")


def snapshot(run_dir: Path) -> dict[str, bytes | None]:
    """Every path under a run directory, with the bytes of its files."""
    return {str(p.relative_to(run_dir)): p.read_bytes() if p.is_file() else None for p in sorted(run_dir.rglob("*"))}


# ------------------------------------------------------------------------ finished runs


def test_a_finished_run_is_not_resumed_and_its_record_is_untouched(tmp_path, capsys):
    config = small(tmp_path / "runs")
    run_dir = run_here(config).run_dir
    before = snapshot(run_dir)
    with pytest.raises(ConfigError, match=rf"{run_dir} finished \(status ok\); a finished run is not resumed"):
        Trainer(parse_experiment(config), DistEnv(), show_progress=False, resume=run_dir)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", str(tmp_path / "config.yaml"), "--resume", str(run_dir), "--no-progress"]) == 2
    assert "a finished run is not resumed" in capsys.readouterr().err
    assert snapshot(run_dir) == before  # grads, data_s and the rest as the run wrote them
    with pytest.raises(ConfigError, match="no unfinished run of this experiment"):
        find_resumable(parse_experiment(config), 1)  # --resume alone does not pick it either


# ------------------------------------------------------------------------- checkpoints


def test_no_checkpoint_that_verifies_refuses_before_anything_changes(tmp_path):
    config = small(tmp_path / "runs")
    run_dir = failed_run(config)
    assert [c.step for c in complete_checkpoints(run_dir)] == [6, 9]
    (run_dir / "checkpoints/step-000009/meta.json").write_text('{"step": 9, "form')  # torn manifest
    (run_dir / "checkpoints/step-000006/state.pt").unlink()
    before = snapshot(run_dir)
    with pytest.raises(ConfigError) as refused:
        Trainer(parse_experiment(config), DistEnv(), show_progress=False, resume=run_dir)
    assert "no usable checkpoint" in str(refused.value)
    assert "step-000009: its meta.json cannot be read" in str(refused.value)
    assert "step-000006: state.pt is missing" in str(refused.value)
    assert snapshot(run_dir) == before  # steps.jsonl not cut, resumed_at_steps not updated, nothing set aside


def test_a_checkpoint_whose_steps_are_not_all_recorded_gives_way_to_an_older_one(tmp_path, capsys):
    full = run_here(small(tmp_path / "full"))
    config = small(tmp_path / "runs")
    run_dir = failed_run(config)
    steps = (run_dir / "steps.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "steps.jsonl").write_text("".join(steps[:7]))  # lost the records of steps 8-10
    record = run_here(config, resume=run_dir).record
    assert record.resumed_at_steps == [6]
    assert losses(run_dir) == [s.loss for s in full.combined]
    assert "passed over step-000009 (steps.jsonl holds only 7 of its 9 steps; left in place)" in capsys.readouterr().err


def test_a_checkpoint_without_checksums_is_used_and_said_to_be_unverified(tmp_path, capsys):
    full = run_here(small(tmp_path / "full"))
    config = small(tmp_path / "runs")
    run_dir = failed_run(config)
    meta_file = run_dir / "checkpoints/step-000009/meta.json"
    meta = json.loads(meta_file.read_text())
    assert set(meta["files"]) == {"state.pt", "rng-rank0.pt"}
    meta_file.write_text(json.dumps({k: v for k, v in meta.items() if k != "files"}))  # as an older kanscale wrote it
    assert run_here(config, resume=run_dir).record.resumed_at_steps == [9]
    assert losses(run_dir) == [s.loss for s in full.combined]
    assert (
        "step-000009 was written without checksums (by an earlier kanscale) and is used unverified"
        in capsys.readouterr().err
    )


def corrupt(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:  # one flipped bit in the middle: a file that still loads, with a wrong number in it
        middle = len(data) // 2
        path.write_bytes(data[:middle] + bytes([data[middle] ^ 0x10]) + data[middle + 1 :])


CORRUPTED = {"ddp": ("state.pt", "truncate"), "fsdp2": ("__1_0.distcp", "flip")}  # fsdp2: rank 1's own shard


@pytest.fixture(scope="module")
def corrupted_runs(tmp_path_factory):
    """Under ddp and fsdp2, 2 ranks: a full run, a run failing at step 11 whose newest checkpoint
    (step 9) is then corrupted, and its resume."""
    tmp = tmp_path_factory.mktemp("corrupted")
    configs = {key: small(tmp / key, {"name": key}) for key in CORRUPTED}
    first = run_jobs(
        [
            job
            for key, cfg in configs.items()
            for job in ({"id": f"{key}/full", "config": cfg}, {"id": f"{key}/failed", "config": failing(cfg)})
        ],
        tmp,
    )
    for key, (name, how) in CORRUPTED.items():
        assert first[f"{key}/full"]["status"] == "ok" and "injected fault" in first[f"{key}/failed"]["error"]
        (failed,) = [d for d in (tmp / key).iterdir() if read_summary(d).status == "failed"]
        corrupt(failed / "checkpoints/step-000009" / name, how)
    second = run_jobs([{"id": f"{key}/resumed", "config": cfg, "resume": True} for key, cfg in configs.items()], tmp)
    return tmp, first, second


@pytest.mark.parametrize("strategy", list(CORRUPTED))
def test_a_corrupt_latest_checkpoint_is_set_aside_and_the_previous_one_resumed(corrupted_runs, strategy):
    _tmp, first, second = corrupted_runs
    resumed = second[f"{strategy}/resumed"]
    assert resumed["status"] == "ok" and resumed["resumed_at_steps"] == [6]
    assert resumed["losses"] == first[f"{strategy}/full"]["losses"] and len(resumed["losses"]) == 12
    run_dir = Path(resumed["run_dir"])
    assert losses(run_dir) == first[f"{strategy}/full"]["losses"]
    assert (run_dir / "checkpoints/step-000009.corrupt" / CORRUPTED[strategy][0]).is_file()  # kept to look at
    assert [c.step for c in complete_checkpoints(run_dir)] == [9, 12]  # written again by the resumed run


# ---------------------------------------------------------------------------- permissions


@pytest.mark.parametrize("umask", [0o002, 0o022])
def test_every_file_of_a_run_follows_the_umask(tmp_path, umask):
    """A failed run and its resume, so that checkpoints, failure reports, locks and a rewritten
    steps.jsonl are among the files."""
    args = [
        "train",
        QUICKSTART,
        "--out",
        str(tmp_path),
        "--no-progress",
        "--set",
        "training.steps=12",
        "--set",
        "training.checkpoint_every=4",
    ]
    fault = ["--set", "fault.rank=all", "--set", "fault.step=10", "--set", "fault.kind=exception"]
    script = (
        f"import os, sys\nos.umask({umask})\nfrom launchers.cli import main\n"
        f"assert main({[*args, *fault]!r}) == 1\nassert main({[*args, '--resume']!r}) == 0\n"
    )
    run([sys.executable, "-c", script])
    (run_dir,) = list(tmp_path.iterdir())
    paths = list(run_dir.rglob("*"))
    wrong = {
        str(p.relative_to(run_dir)): oct(p.stat().st_mode & 0o777)
        for p in paths
        if p.stat().st_mode & 0o777 != (0o777 if p.is_dir() else 0o666) & ~umask
    }
    assert wrong == {}
    assert {"summary.json", "config.yaml", "steps.jsonl", LOCK_FILE, "meta.json", "state.pt", "rank0.json"} <= {
        p.name for p in paths
    }
