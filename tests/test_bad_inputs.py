"""The malformed-input corpus (tests/bad_inputs/): every case fails before any process starts,
exits non-zero, and prints one message naming the field and the fix, with no traceback."""

from pathlib import Path

import pytest
import yaml

from launchers.cli import main

BAD = Path(__file__).resolve().parent / "bad_inputs"
# cases.yaml and any cases_<topic>.yaml beside it
CASES = [case for path in sorted(BAD.glob("cases*.yaml")) for case in yaml.safe_load(path.read_text())]


def test_the_corpus_is_large_enough():
    assert len(CASES) >= 25 and len({c["name"] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_bad_input_is_refused_before_launch(case, tmp_path, monkeypatch, capsys):
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    out_file = tmp_path / "taken"
    out_file.write_text("")
    fill = {"{out_dir}": str(tmp_path / "out"), "{out_file}": str(out_file)}
    args = [str(BAD / a) if (BAD / a).is_file() else fill.get(a, a) for a in case["command"]]
    if args[0] in ("train", "run") and "--out" not in args:
        args += ["--out", str(tmp_path / "out")]
    try:
        code = main(args)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    err = capsys.readouterr().err
    expected = case["expect"].replace("{out_file}", str(out_file))
    assert code != 0
    assert expected in err, err
    assert "Traceback" not in err
    assert len([line for line in err.splitlines() if line.startswith(("kanscale: error", "kanscale:", "usage:"))]) <= 2
    assert not (tmp_path / "out").exists() and list(workdir.iterdir()) == []  # nothing was started or written
