"""Switching a model's family or a task from the command line: the file's keys of the old family
or task are left out with a note; a misspelling is still refused."""

import re
import shlex
from pathlib import Path

import pytest

from kanscale.errors import ConfigError
from launchers.cli import main
from strategies.experiment import load_experiment

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "configs/experiments/quickstart.yaml")


def test_the_readmes_family_switch_trains_as_documented(tmp_path, capsys, monkeypatch):
    """The user guide's (docs/guide.md, once the README's) third `kanscale train` example, as
    written there (it failed on grid, k, grid_range)."""
    guide = (ROOT / "docs/guide.md").read_text()
    command = next(
        c.replace("\\\n", " ")
        for c in re.findall(r"^kanscale train .*?(?<!\\)$", guide, re.M | re.S)
        if "model.family=chebyshev" in c
    )
    args = shlex.split(command)[1:]
    monkeypatch.chdir(ROOT)
    assert main([*args, "--out", str(tmp_path), "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "left out grid, k, grid_range of the file's bspline model, which chebyshev does not take" in captured.err
    assert "chebyshev [2, 16, 1]" in captured.out


def test_a_task_switched_to_sklearn_leaves_the_synthetic_keys_out(capsys):
    cfg = load_experiment(QUICKSTART, ["task.name=sklearn", "task.dataset=diabetes", "model.widths=[10,8,1]"])
    assert cfg.task.name == "sklearn" and cfg.task.dataset == "diabetes"
    assert "left out n_train, n_test, noise_std of the file's quadratic task" in capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides, refused",
    [
        (["model.family=chebyshev", "model.degre=6"], "model.degre: unknown key; did you mean 'degree'?"),
        # a key of the old family given on the command line is meant, so it is refused, not dropped
        (["model.family=chebyshev", "model.grid=5"], "model.grid: unknown key"),
    ],
)
def test_what_the_user_typed_is_still_checked(overrides, refused):
    with pytest.raises(ConfigError, match=re.escape(refused)):
        load_experiment(QUICKSTART, overrides)


def test_a_misspelled_key_in_the_file_is_still_refused_after_a_switch(tmp_path):
    text = Path(QUICKSTART).read_text().replace("  k: 3 ", "  kk: 3 ")
    (tmp_path / "typo.yaml").write_text(text)
    with pytest.raises(ConfigError, match=re.escape("model.kk: unknown key")):
        load_experiment(tmp_path / "typo.yaml", ["model.family=chebyshev"])
