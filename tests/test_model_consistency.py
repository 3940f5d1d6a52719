"""A model built differently on some rank is refused by name, and a compiled model that is not
one graph says so in its record."""

import subprocess
import sys
from pathlib import Path

from analysis.records.run_files import read_summary
from launchers.cli import main

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "configs/experiments/quickstart.yaml")
FACTORIES = '''
import os
from torch import nn


def by_rank(hidden=8):
    """A hidden width that depends on the rank: another model on every rank."""
    h = hidden + int(os.environ.get("RANK", "0"))
    return nn.Sequential(nn.Linear(2, h), nn.SiLU(), nn.Linear(h, 1))


class Printing(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.a, self.b = nn.Linear(2, hidden), nn.Linear(hidden, 1)

    def forward(self, x):
        print("", end="")  # torch.compile cannot trace print: a graph break
        return self.b(self.a(x))


def printing(hidden=8):
    return Printing(hidden)
'''


def custom(tmp_path: Path, name: str) -> list[str]:
    (tmp_path / "factories.py").write_text(FACTORIES)
    return [
        "--set",
        f'model={{family: custom, widths: [2, 1], factory: "{tmp_path}/factories.py:{name}"}}',
        "--set",
        "training.steps=12",
        "--set",
        "training.epochs=null",
        "--out",
        str(tmp_path / "runs"),
        "--no-progress",
    ]


def test_a_factory_that_builds_another_model_on_some_rank_is_refused_on_every_rank(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "launchers.cli",
            "train",
            QUICKSTART,
            "--strategy",
            "ddp",
            *custom(tmp_path, "by_rank"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert proc.stderr.count("model: rank(s) [1] built a model other than rank 0's") == 2, proc.stderr[-3000:]
    assert "model.factory" in proc.stderr


def test_a_graph_break_in_a_compiled_model_is_recorded(tmp_path, capsys):
    assert main(["train", QUICKSTART, *custom(tmp_path, "printing"), "--set", "training.compile=model"]) == 0
    assert "NOT one graph" in capsys.readouterr().out
    record = read_summary(next((tmp_path / "runs").iterdir()))
    assert any("builtin operator" in reason for reason in record.compile.graph_breaks), record.compile


def test_a_zoo_model_compiles_to_one_graph_with_the_suites_own_hooks(tmp_path, capsys):
    out = tmp_path / "zoo"
    assert (
        main(
            [
                "train",
                QUICKSTART,
                "--set",
                "training.steps=12",
                "--set",
                "training.epochs=null",
                "--set",
                "training.compile=model",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    assert "one graph per compiled region" in capsys.readouterr().out
    assert read_summary(next(out.iterdir())).compile.graph_breaks == []
