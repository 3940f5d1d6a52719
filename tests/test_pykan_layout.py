"""pykan as the suite trains it under DDP: grid refits planned and run (the checks before launch
cannot build pykan on the meta device), and torch's warning that its gradients miss their
buckets' layout explained once per launch, not printed by every rank at every step."""

import sys

import pytest

from kan_models.pykan_adapter import PyKANConfig
from tests.helpers.launch import run

pytest.importorskip("kan")


def test_pykan_refits_its_grids():
    assert PyKANConfig(family="pykan", widths=[2, 8, 1]).refits_grids()


@pytest.mark.slow
def test_pykan_under_ddp_refits_grids_without_a_layout_warning(tmp_path):
    command = [sys.executable, "-m", "launchers.cli", "run", "configs/experiments/quickstart.yaml"]
    command += ["--strategy", "ddp", "--nproc-per-node", "2", "--out", str(tmp_path)]
    settings = ["model.family=pykan", "model.widths=[2,8,1]", "training.steps=6", "training.warmup_steps=1"]
    settings += ["training.grid_update_every=2"]
    done = run(command + [flag for s in settings for flag in ("--set", s)])
    assert "[ok]" in done.stdout
    assert "Grad strides do not match" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.count("DDP: some gradients are laid out unlike their parameters") == 1, done.stderr[-2000:]
