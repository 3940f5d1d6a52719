"""A strategy preset of the user's own (a variant of a shipped one, in a file of theirs) trains,
analyzes and projects with no change to the suite: each part takes the strategy from its class."""

import json
import sys

import yaml

from analysis.records.run_files import read_summary
from launchers.cli import main
from tests.helpers.launch import ROOT, run


def test_a_users_own_ddp_variant_trains_analyzes_and_projects(tmp_path, capsys):
    preset = tmp_path / "my_ddp.yaml"
    preset.write_text(yaml.safe_dump({"name": "ddp", "bucket_cap_mb": 1.0, "static_graph": True}))
    runs = tmp_path / "runs"
    quick = ["--set", "training.steps=12", "--set", "training.micro_batch=64", "--set", "measurement.baseline_steps=1"]
    run(
        [
            sys.executable,
            "-m",
            "launchers.cli",
            "run",
            "quickstart",
            "--strategy",
            str(preset),
            "--nproc-per-node",
            "2",
            "--out",
            str(runs),
            *quick,
        ]
    )
    assert main(["train", "quickstart", "--out", str(runs), "--no-progress", *quick]) == 0
    records = {r.topology.world_size: r for r in (read_summary(p) for p in runs.glob("*/summary.json"))}
    assert records[2].status == "ok" and records[2].strategy.options["bucket_cap_mb"] == 1.0
    assert records[2].strategy.options["static_graph"] is True  # what ran is what the file said
    capsys.readouterr()
    assert main(["analyze", str(runs)]) == 0
    assert "ddp" in capsys.readouterr().out
    out = tmp_path / "projection.json"
    assert (
        main(
            [
                "project",
                "--profile",
                str(runs),
                "--cluster",
                str(ROOT / "configs/clusters/a100_ib.yaml"),
                "--strategies",
                str(preset),
                "--ranks",
                "1,2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert {(r["strategy"], r["ranks"]) for r in rows} == {("ddp", 1), ("ddp", 2)}


def test_a_preset_file_that_is_not_there_is_named_as_a_strategy_file(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "quickstart", "--strategy", "my_ddp.yaml"]) == 2
    assert "--strategy: strategy file my_ddp.yaml does not exist" in capsys.readouterr().err
