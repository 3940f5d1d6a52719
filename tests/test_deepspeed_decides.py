"""A DeepSpeed file as DeepSpeed's own examples write it (fixed train_batch_size, micro-batch,
accumulation and clipping, an optimizer and a scheduler with values) against an experiment that
sets its own: one refusal names every difference, with the ``--set`` lines that make the
experiment follow the file, the file edit that keeps the experiment's, and the one line
(``strategy.decides``) that says which side wins; each fix is followed here."""

import json
import subprocess
import sys

import pytest

from kanscale.errors import ConfigError
from strategies.experiment import load_experiment
from strategies.native_training import with_native_training
from tests.helpers.launch import ROOT, child_env

# the shape of DeepSpeed's examples (DeepSpeedExamples' ds_config.json files), shipped for the docs
EXAMPLE = ROOT / "configs/deepspeed/examples_style.json"
QUICKSTART = ROOT / "configs/experiments/quickstart.yaml"


@pytest.fixture
def example():
    return EXAMPLE


def resolved(path, *sets: str, ranks: int = 2) -> tuple:
    strategy = f'strategy={{"name": "deepspeed", "config": "{path}"}}'
    cfg = with_native_training(load_experiment(QUICKSTART, [strategy, *sets]))
    return cfg, cfg.strategy.resolve(cfg.training, ranks)


def refusal(path, *sets: str, ranks: int = 2) -> str:
    with pytest.raises(ConfigError) as err:
        resolved(path, *sets, ranks=ranks)
    return str(err.value)


def test_one_refusal_names_every_difference_and_every_fix(example):
    said = refusal(example)
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping", "optimizer."):
        assert key in said
    assert "--set strategy.decides=file" in said and "--set strategy.decides=experiment" in said
    # the file's values, as --set lines: followed, the same file runs at the ranks that make its 64
    file_side = said.split("to train with the file's values: ")[1].split(";")[0].split(" --set ")
    sets = [line.removeprefix("--set ") for line in file_side]
    cfg, config = resolved(example, *sets)
    assert (cfg.training.micro_batch, cfg.training.grad_accum, cfg.training.lr) == (16, 2, 0.001)
    assert config["train_batch_size"] == 64
    # at other ranks, train_batch_size is named with the launch that makes it
    assert "launch 2 data-parallel rank(s)" in refusal(example, *sets, ranks=4)


def test_decides_file_takes_every_value_the_file_states_and_records_it(example):
    cfg, config = resolved(example, "strategy.decides=file")
    t = cfg.training
    assert (t.micro_batch, t.grad_accum, t.grad_clip, t.optimizer, t.lr, t.betas) == (
        16,
        2,
        1.0,
        "adamw",
        0.001,
        (0.8, 0.999),
    )
    assert t.schedule.name == "warmup" and t.schedule.warmup_steps == 2
    assert config["train_micro_batch_size_per_gpu"] == 16 and config["train_batch_size"] == 64
    assert "training.micro_batch" in t._adopted and "examples_style.json" in t._adopted["training.micro_batch"]


def test_decides_experiment_keeps_every_value_the_experiment_sets(example):
    base = load_experiment(QUICKSTART).training
    cfg, config = resolved(example, "strategy.decides=experiment")
    t = cfg.training
    assert (t.micro_batch, t.grad_accum, t.grad_clip, t.lr) == (
        base.micro_batch,
        base.grad_accum,
        base.grad_clip,
        base.lr,
    )
    assert config["train_micro_batch_size_per_gpu"] == base.micro_batch
    assert config["train_batch_size"] == base.micro_batch * base.grad_accum * 2
    assert config["gradient_clipping"] == base.grad_clip and "optimizer" not in config
    assert config["zero_optimization"]["stage"] == 2  # what the file says of the backend stays
    assert not t._adopted


@pytest.mark.slow
def test_an_example_file_trains_with_the_one_line_the_refusal_offers(example, tmp_path):
    command = [sys.executable, "-m", "launchers.cli", "run", str(QUICKSTART), "--deepspeed-config", str(example)]
    command += ["--nproc-per-node", "2", "--out", str(tmp_path / "runs"), "--set", "training.steps=6"]
    command += ["--set", "training.warmup_steps=1"]
    refused = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=child_env(), timeout=300)
    assert refused.returncode != 0 and "--set strategy.decides=file" in refused.stderr
    done = subprocess.run(
        [*command, "--set", "strategy.decides=file"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=child_env(),
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (summary,) = (tmp_path / "runs").rglob("summary.json")
    record = json.loads(summary.read_text())
    assert record["batch"]["micro_batch"] == 16 and record["batch"]["global_batch"] == 64
    assert "training.micro_batch" in record["strategy"]["adopted"]
