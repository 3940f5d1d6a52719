"""Every input is bounded: YAML and JSON nested deeper than any config are refused by name, not
with a RecursionError; a name too long for the run folder it names is refused by its length; no
message repeats more than a few hundred characters of what was typed (a multi-megabyte argument
came back whole); a name no file system could hold is a missing preset, not an OSError."""

import json

import pytest

from launchers.cli import main
from tests.helpers.cli import refused

HUGE = "x" * 100_000
DEEP = 5_000


def deep_list(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("where", ["experiment", "study", "set"])
def test_yaml_nested_too_deep_is_refused_by_name(tmp_path, capsys, where):
    deep = tmp_path / "deep.yaml"
    if where == "experiment":
        deep.write_text(f"name: deep\nmodel: {deep_list(DEEP)}\n")
        argv = ["train", str(deep)]
    elif where == "study":
        deep.write_text(f"study: deep\nmatrix: {{strategy: {deep_list(100)}}}\n")
        argv = ["sweep", str(deep), "--out", str(tmp_path / "runs")]
    else:
        argv = ["train", "quickstart", "--set", f"model.widths={deep_list(DEEP)}"]
    err = refused(argv, capsys)
    assert "nests lists and mappings more than 64 deep" in err and "flatten it" in err
    assert len(err) < 600


@pytest.mark.parametrize("depth", [100, 20_000])
def test_json_nested_too_deep_is_refused_by_name(tmp_path, capsys, depth):
    deep = tmp_path / "ds.json"
    deep.write_text(json.dumps({"zero_optimization": {"stage": 2}})[:-1] + f', "x": {deep_list(depth)}}}')
    code = main(["run", "quickstart", "--deepspeed-config", str(deep), "--dry-run", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "RecursionError" not in err
    assert f"{deep}: it nests" in err and "flatten it" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "quickstart", "--strategy", HUGE],
        ["train", "quickstart", "--set", f"name={HUGE}"],
        ["train", "quickstart", "--set", f"model.family={HUGE}"],
        ["train", HUGE],
        ["run", "quickstart", "--strategy", "ddp", "--hosts", HUGE, "--dry-run"],
        ["run", "quickstart", "--launcher", HUGE],
        ["recommend", "quickstart", "--strategies", f"ddp,{HUGE}", "--cluster", "configs/clusters/a100_ib.yaml"],
        ["rehearse", "quickstart", "--strategies", HUGE],
    ],
)
def test_no_refusal_repeats_a_huge_argument_whole(tmp_path, capsys, argv):
    try:
        code = main([*argv, "--out", str(tmp_path / "r")] if argv[0] in ("train", "run") else argv)
    except SystemExit as refusal:  # argparse's own, for a choice it does not know
        code = refusal.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and 0 < len(err) < 2_000, err[:3000]  # argparse adds its usage
    assert "x" * 201 not in err


def test_a_name_too_long_for_its_run_folder_is_refused_by_its_length(tmp_path, capsys):
    assert main(["train", "quickstart", "--set", f"name={'n' * 201}", "--out", str(tmp_path)]) == 2
    assert "name: String should have at most 200 characters" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
