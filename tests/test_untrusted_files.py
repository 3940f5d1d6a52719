"""Security of the files a user names: none is unpickled (``training.init_from``, a checkpoint
``kanscale export`` reads), an export is plain data, and a pathological YAML (an alias bomb, in
an experiment, a --set value or a study) gets a short message within the command's timeout."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launchers.cli import main
from strategies.lifecycle.checkpoint import META_FILE, file_digests

ROOT = Path(__file__).resolve().parents[1]
VALID = ROOT / "tests/bad_inputs/valid_experiment.yaml"


class Payload:
    """What a crafted checkpoint holds: unpickling it runs ``touch <path>``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.path))}",)


def test_init_from_never_unpickles_a_file(tmp_path, capsys):
    marker = tmp_path / "PWNED"
    crafted = tmp_path / "model.pt"
    torch.save({"model_state": {"w": torch.zeros(1)}, "model": Payload(marker)}, crafted)
    assert (
        main(
            [
                "train",
                str(VALID),
                "--strategy",
                "single",
                "--set",
                f"training.init_from={crafted}",
                "--out",
                str(tmp_path / "out"),
                "--no-progress",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert f"training.init_from: {crafted} is not a kanscale export, or it holds Python objects" in err
    assert "never unpickles" in err and len(err) < 1000
    assert not marker.exists()


def test_export_never_unpickles_a_checkpoint_file(tmp_path, capsys):
    marker = tmp_path / "PWNED"
    checkpoint = tmp_path / "run/checkpoints/step-000010"
    checkpoint.mkdir(parents=True)
    model = {"family": "bspline", "widths": [2, 8, 1], "grid": 5, "k": 3}
    (checkpoint / "meta.json").write_text(
        json.dumps(
            {
                "run_id": "r",
                "step": 10,
                "strategy": "single",
                "format": "torch",
                "world_size": 1,
                "config": {"model": model, "training": {"dtype": "float32"}},
            }
        )
    )
    torch.save({"model": {"w": Payload(marker)}, "optimizer": {}}, checkpoint / "state.pt")
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "model.pt")]) == 2
    err = capsys.readouterr().err
    assert f"export: {checkpoint} holds a file that is not a kanscale checkpoint, or holds Python objects" in err
    assert not marker.exists() and not (tmp_path / "model.pt").exists()


def test_an_export_is_plain_data_and_starts_a_run(tmp_path, capsys):
    common = [str(VALID), "--strategy", "single", "--set", "training.steps=10", "--no-progress"]
    assert main(["train", *common, "--set", "training.checkpoint_every=10", "--out", str(tmp_path / "a")]) == 0
    (run_dir,) = (tmp_path / "a").iterdir()
    model = tmp_path / "my model; v1.pt"
    assert main(["export", str(run_dir), "--out", str(model)]) == 0
    shown = capsys.readouterr().out.splitlines()[-1]
    assert shlex.split(shown.partition(": ")[2])[-2:] == ["--set", f"training.init_from={model}"]  # pastes as it reads
    exported = torch.load(model, weights_only=True)  # tensors and JSON types only
    assert json.loads(json.dumps(exported["model"])) == exported["model"] and exported["model"]["family"] == "bspline"
    assert json.loads(json.dumps(exported["source"])) == exported["source"]
    assert main(["train", *common, "--set", f"training.init_from={model}", "--out", str(tmp_path / "b")]) == 0
    # an export of another grid is refused before training, naming what differs (the family says what counts)
    capsys.readouterr()
    assert (
        main(
            [
                "train",
                *common,
                "--set",
                f"training.init_from={model}",
                "--set",
                "model.grid=7",
                "--out",
                str(tmp_path / "c"),
            ]
        )
        == 2
    )
    assert "differs from this experiment's in grid; use an export of the same model" in capsys.readouterr().err


# ------------------------------------------------------------------------------- bounded messages


def alias_bomb(depth: int = 9, width: int = 9) -> str:
    """Flow-style YAML whose anchors nest ``depth`` deep: a few hundred characters that expand
    to width**depth strings (9**9 is 387 million)."""
    text = "[&l0 [" + ",".join(["lol"] * width) + "]"
    for level in range(1, depth - 1):
        text += f", &l{level} [" + ",".join([f"*l{level - 1}"] * width) + "]"
    return text + ", [" + ",".join([f"*l{depth - 2}"] * width) + "]]"


def kanscale(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``kanscale ARGS`` in its own process: a hang is a failure (the timeout), not a stuck suite."""
    return subprocess.run(
        [sys.executable, "-m", "launchers.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_an_alias_bomb_in_an_experiment_gets_a_short_message_quickly(tmp_path):
    config = tmp_path / "bomb.yaml"
    config.write_text(VALID.read_text() + f"study: {alias_bomb()}\n")
    done = kanscale("run", str(config), "--dry-run", "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.startswith("kanscale: error: ") and len(done.stderr) < 2000


def test_an_alias_bomb_in_a_set_value_gets_a_short_message_quickly(tmp_path):
    done = kanscale(
        "run", str(VALID), "--set", f"study={alias_bomb()}", "--dry-run", "--out", str(tmp_path / "out"), cwd=tmp_path
    )
    assert done.returncode == 2 and done.stderr.startswith("kanscale: error: ") and len(done.stderr) < 2000


def test_an_alias_bomb_in_a_study_gets_a_short_message_quickly(tmp_path):
    """A study's ``set`` values are written out into every point's overrides: the expansion
    itself must be refused where the YAML is read (9**7 strings: 30 MB of override text)."""
    study = tmp_path / "study.yaml"
    study.write_text(
        f"study: bomb\nexperiment: {VALID}\nset:\n  study: {alias_bomb(depth=7)}\n"
        "matrix:\n  strategy: [single]\n  topology: [1x1]\n"
    )
    done = kanscale("sweep", str(study), "--dry-run", "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.startswith("kanscale: error: ") and len(done.stderr) < 2000


@pytest.mark.parametrize("crafted_file", ["state.pt", "rng-rank0.pt"])
def test_a_resume_never_unpickles_a_checkpoint_and_says_which_file_it_refused(tmp_path, capsys, crafted_file):
    """A checkpoint file that holds anything but tensors and plain containers is named with what
    it held, and torch's advice to load it with weights_only=False is not relayed."""
    marker = tmp_path / "PWNED"
    common = [str(VALID), "--strategy", "single", "--set", "training.steps=6", "--no-progress"]
    common += ["--set", "training.checkpoint_every=2"]
    cut = ["--set", "fault.rank=0", "--set", "fault.step=3", "--set", "fault.kind=exception"]
    assert main(["train", *common, *cut, "--out", str(tmp_path / "a")]) == 1  # stopped after step 2's checkpoint
    (run_dir,) = (tmp_path / "a").iterdir()
    (checkpoint,) = (run_dir / "checkpoints").iterdir()
    torch.save({"model": {"w": Payload(marker)}, "optimizer": {}}, checkpoint / crafted_file)
    meta = json.loads((checkpoint / META_FILE).read_text())  # the crafter rewrites the checksums too
    meta["files"] = file_digests(checkpoint)
    (checkpoint / META_FILE).write_text(json.dumps(meta))
    capsys.readouterr()
    assert main(["train", *common, "--resume", str(run_dir), "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint file {checkpoint / crafted_file} was not loaded: " in err and "never unpickles" in err
    assert "weights_only=False" not in err and len(err) < 1000
    assert not marker.exists()
