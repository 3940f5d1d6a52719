"""`kanscale export` reads a checkpoint only once it verifies, by the same check a resume makes:
of a run directory it takes the newest checkpoint that verifies and says which it skipped and why;
a checkpoint directory named on the command line that fails verification, was set aside as
corrupt, is a partial save or has no manifest is refused with exit 2 and one line; an export
never writes into the checkpoint or run it reads. Real runs, real files."""

import os
import shutil
from pathlib import Path

import pytest
import torch

from launchers.cli import main
from strategies.experiment import parse_experiment
from strategies.lifecycle.checkpoint import set_aside
from strategies.loop.trainer import Trainer
from strategies.runtime.distributed import DistEnv
from tests.helpers.cli import refused
from tests.helpers.launch import run_jobs


def experiment(out: Path, strategy: dict | None = None) -> dict:
    """12 steps, a checkpoint every 6: step-000006 and step-000012 are kept."""
    return {
        "name": "export_verify",
        "model": {"family": "bspline", "widths": [2, 4, 1], "grid": 3, "grid_range": [-2.0, 2.0]},
        "task": {"name": "quadratic", "n_train": 256, "n_test": 32},
        "training": {"seed": 5, "lr": 0.02, "micro_batch": 32, "steps": 12, "warmup_steps": 1, "checkpoint_every": 6},
        "strategy": strategy or {"name": "single"},
        "measurement": {"baseline_steps": 1},
        "runtime": {"device": "cpu", "threads": 1},
        "output": {"dir": str(out)},
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A real one-process run with two checkpoints."""
    trainer = Trainer(parse_experiment(experiment(tmp_path_factory.mktemp("trained"))), DistEnv(), show_progress=False)
    trainer.run()
    return trainer.run_dir


@pytest.fixture
def run_dir(trained, tmp_path) -> Path:
    """A copy of the trained run for one test to damage."""
    return Path(shutil.copytree(trained, tmp_path / trained.name))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_a_bit(path: Path) -> None:
    """A file that still loads, with one wrong number in it."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def tree(directory: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(directory)): p.read_bytes() if p.is_file() else None for p in sorted(directory.rglob("*"))
    }


def exported_from(model: Path) -> tuple[int, dict[str, torch.Tensor]]:
    exported = torch.load(model, weights_only=True)
    return exported["source"]["step"], exported["model_state"]


def saved_model(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint / "state.pt", weights_only=True)["model"]


@pytest.mark.parametrize(
    "damage,why",
    [
        (truncate, "state.pt does not match its checksum"),
        (flip_a_bit, "state.pt does not match its checksum"),
        (lambda p: p.unlink(), "state.pt is missing"),
    ],
)
def test_a_run_whose_newest_checkpoint_is_damaged_exports_the_older_one_and_says_so(
    run_dir, tmp_path, capsys, damage, why
):
    damage(run_dir / "checkpoints/step-000012/state.pt")
    before = tree(run_dir)
    model = tmp_path / "model.pt"
    assert main(["export", str(run_dir), "--out", str(model)]) == 0
    err = capsys.readouterr().err
    assert f"kanscale: export {run_dir}: skipped step-000012 ({why}" in err and "left in place" in err
    assert "exporting step-000006, the newest checkpoint that verifies" in err
    step, state = exported_from(model)
    expected = saved_model(run_dir / "checkpoints/step-000006")
    assert step == 6 and state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in state)
    assert tree(run_dir) == before  # an export changes nothing in a run: the damaged one is not even renamed


def test_a_file_export_does_not_read_is_verified_too(run_dir, tmp_path, capsys):
    """The same verification as a resume's: every file the manifest lists, rng states included."""
    flip_a_bit(run_dir / "checkpoints/step-000012/rng-rank0.pt")
    assert main(["export", str(run_dir), "--out", str(tmp_path / "model.pt")]) == 0
    assert "skipped step-000012 (rng-rank0.pt does not match its checksum" in capsys.readouterr().err
    assert exported_from(tmp_path / "model.pt")[0] == 6


def test_a_run_whose_only_checkpoint_is_corrupt_is_refused_in_one_line(run_dir, tmp_path, capsys):
    shutil.rmtree(run_dir / "checkpoints/step-000006")
    truncate(run_dir / "checkpoints/step-000012/state.pt")
    model = tmp_path / "model.pt"
    err = refused(["export", str(run_dir), "--out", str(model)], capsys)
    assert (
        f"kanscale: error: export: {run_dir} has no checkpoint that verifies (step-000012: state.pt does not match "
        "its checksum (truncated or altered since it was saved)); none of it can be exported"
    ) in err
    assert not model.exists()


def set_aside_copy(checkpoints: Path) -> Path:
    """step-000012, intact, renamed as a resume sets aside a checkpoint that failed verification."""
    return set_aside(checkpoints / "step-000012")


def partial_copy(checkpoints: Path) -> Path:
    """step-000012 renamed as a save in progress, its manifest and all."""
    return (checkpoints / "step-000012").rename(checkpoints / "step-000012.tmp")


def without_manifest(checkpoints: Path) -> Path:
    (checkpoints / "step-000012/meta.json").unlink()
    return checkpoints / "step-000012"


def truncated(checkpoints: Path) -> Path:
    truncate(checkpoints / "step-000012/state.pt")
    return checkpoints / "step-000012"


@pytest.mark.parametrize(
    "make,said",
    [
        (
            set_aside_copy,
            "was set aside by a resume because it failed verification (a .corrupt checkpoint is never read)",
        ),
        (partial_copy, "is no complete checkpoint (a save that did not finish, ending in .tmp, or without meta.json"),
        (without_manifest, "fails verification: its meta.json cannot be read"),
        (
            truncated,
            "fails verification: state.pt does not match its checksum (truncated or altered since it was saved)",
        ),
    ],
)
def test_a_checkpoint_given_by_name_is_refused_unless_it_verifies(run_dir, tmp_path, capsys, make, said):
    checkpoint = make(run_dir / "checkpoints")
    model = tmp_path / "model.pt"
    err = refused(["export", str(checkpoint), "--out", str(model)], capsys)
    assert f"kanscale: error: export: {checkpoint} {said}" in err
    assert f"export the run directory {run_dir} instead, which takes its newest checkpoint that verifies" in err
    assert not model.exists()
    # and what it recommends works: the run directory exports its step-6 checkpoint
    assert main(["export", str(run_dir), "--out", str(model)]) == 0 and exported_from(model)[0] == 6


def test_a_checkpoint_given_by_name_that_verifies_is_exported(run_dir, tmp_path, capsys):
    model = tmp_path / "model.pt"
    assert main(["export", str(run_dir / "checkpoints/step-000006"), "--out", str(model)]) == 0
    step, state = exported_from(model)
    expected = saved_model(run_dir / "checkpoints/step-000006")
    assert step == 6 and all(torch.equal(state[k], expected[k]) for k in expected)
    assert "skipped" not in capsys.readouterr().err


@pytest.mark.slow
def test_a_dcp_checkpoint_with_a_flipped_bit_in_one_rank_shard_is_skipped(tmp_path, capsys):
    """fsdp2 at world size 2: DCP writes a shard per rank (``__<rank>_0.distcp``) and a
    ``.metadata`` file, which export merges offline; rank 1's shard of the newest checkpoint
    damaged (it still loads, with a wrong number) is found by its checksum, not exported."""
    results = run_jobs([{"id": "fsdp2", "config": experiment(tmp_path / "runs", {"name": "fsdp2"})}], tmp_path)
    run_dir = Path(results["fsdp2"]["run_dir"])
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "step-000012/__1_0.distcp").is_file()
    reference = tmp_path / "step6.pt"
    assert main(["export", str(checkpoints / "step-000006"), "--out", str(reference)]) == 0
    flip_a_bit(checkpoints / "step-000012/__1_0.distcp")
    capsys.readouterr()
    model = tmp_path / "model.pt"
    assert main(["export", str(run_dir), "--out", str(model)]) == 0
    assert "skipped step-000012 (__1_0.distcp does not match its checksum" in capsys.readouterr().err
    step, state = exported_from(model)
    expected = exported_from(reference)[1]
    assert step == 6 and all(torch.equal(state[k], expected[k]) for k in expected)
    err = refused(["export", str(checkpoints / "step-000012"), "--out", str(tmp_path / "refused.pt")], capsys)
    assert f"export: {checkpoints / 'step-000012'} fails verification: __1_0.distcp does not match its checksum" in err


def test_export_refuses_an_out_inside_the_checkpoint_or_the_run_it_reads(run_dir, tmp_path, capsys):
    checkpoint = run_dir / "checkpoints/step-000012"
    state = (checkpoint / "state.pt").read_bytes()
    err = refused(["export", str(checkpoint), "--out", str(checkpoint / "state.pt")], capsys)
    assert f"--out: {checkpoint / 'state.pt'} lies inside the run directory being exported ({run_dir})" in err
    assert f"write the export outside it, e.g. --out {run_dir.parent / (run_dir.name + '.pt')}" in err
    refused(["export", str(run_dir), "--out", str(run_dir / "model.pt")], capsys)
    (tmp_path / "link").symlink_to(run_dir)  # the same run, reached through a symlink
    assert "lies inside the run directory" in refused(
        ["export", str(run_dir), "--out", str(tmp_path / "link/checkpoints/model.pt")], capsys
    )
    assert (checkpoint / "state.pt").read_bytes() == state and not (run_dir / "model.pt").exists()
    assert main(["export", str(tmp_path / "link"), "--out", str(tmp_path / "model.pt")]) == 0  # outside it: exported


def test_export_replaces_its_out_file_rather_than_writing_into_it(run_dir, tmp_path):
    """An --out hard-linked to the checkpoint's own file (which no path check can see) is
    replaced by a new file: the checkpoint keeps its bytes, and no temporary file is left."""
    state = run_dir / "checkpoints/step-000012/state.pt"
    before = state.read_bytes()
    out = tmp_path / "exports/model.pt"
    out.parent.mkdir()
    os.link(state, out)
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    assert state.read_bytes() == before and out.stat().st_ino != state.stat().st_ino
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.pt"]
