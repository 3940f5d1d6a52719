"""A path is a path: ``--out`` and the other path arguments are taken as typed, never read as
YAML (a ``#`` once truncated the folder and a newline was folded, so runs landed elsewhere); what
no file system could hold as typed (a NUL, names and paths over the system's limits) is refused
before anything is made, naming the flag, with a message of bounded length."""

import pytest

from launchers.cli import main
from launchers.launch.request import RunRequest
from tests.helpers.cli import refused

SHORT = ["--strategy", "single", "--set", "training.steps=2", "--set", "training.warmup_steps=1", "--no-progress"]


@pytest.mark.parametrize("name", ["a#b", "a: b", 'it\'s "q" [1]', "ünï cødé", "-leading", "x #y,z: {w}"])
def test_a_run_lands_in_the_folder_as_typed(tmp_path, name):
    folder = tmp_path / name
    assert main(["train", "quickstart", *SHORT, f"--out={folder}"]) == 0
    (run,) = [p.parent for p in folder.glob("*/summary.json")]
    assert run.parent == folder
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # nothing written anywhere else


@pytest.mark.parametrize("name", ["a#b", "a: b\\c", "{x: 1}", "- y"])
def test_a_launch_plans_its_ranks_into_the_folder_as_typed(tmp_path, name):
    request = RunRequest("quickstart", str(tmp_path / name), strategy="ddp")
    assert request.load().output.dir == str(tmp_path / name)
    assert request.train_args()[-2:] == ["--out", str(tmp_path / name)]  # every rank gets it as one argument


@pytest.mark.parametrize(
    "argv, says",
    [
        (["train", "quickstart", "--out", "runs/a\x00b"], "--out: 'runs/a\\x00b' holds a NUL character"),
        (["rehearse", "quickstart", "--json", "r\x00.json"], "--json: 'r\\x00.json' holds a NUL character"),
        (["sweep", "study\x00.yaml", "--out", "runs"], "study: 'study\\x00.yaml' holds a NUL character"),
        (["train", "quickstart", "--out", "runs/" + "n" * 300], "has a name of 300 bytes; the file system holds"),
        (["train", "quickstart", "--out", "/".join(["d" * 200] * 30)], "paths here are shorter than"),
    ],
)
def test_what_no_file_system_takes_as_typed_is_refused_naming_the_flag(tmp_path, monkeypatch, capsys, argv, says):
    monkeypatch.chdir(tmp_path)
    err = refused(argv, capsys)
    assert says in err
    assert list(tmp_path.iterdir()) == []  # refused before anything was made


def test_a_huge_name_is_not_echoed_whole(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    err = refused(["train", "quickstart", "--out", "x" * 3_000_000], capsys)
    assert len(err) < 400 and "(3,000,000 characters)" in err
