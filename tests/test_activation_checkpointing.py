"""training.activation_checkpointing: the layers keep no activations but recompute them, the
arithmetic stays the same under every strategy (two real ranks), and users' native files are
read into the same option or refused, naming the key."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from pydantic import ValidationError

from kan_models import build_model
from launchers.bench import saved_bytes
from strategies.backends.accelerate_launch import launch_config_conflicts
from strategies.backends.deepspeed_training import adopt
from strategies.experiment import load_experiment
from strategies.loop.model_setup import checkpoint_activations
from tests.helpers.launch import ROOT, child_env, run_jobs
from tests.helpers.parity import STRATEGIES, experiment, max_rel_diff, single_losses

RBF = ["model.family=rbf", "model.widths=[8,128,128,1]", "task.name=high_dim", "task.dim=8"]


def step_of(overrides: list[str]) -> tuple[int, list[torch.Tensor]]:
    """The bytes autograd saves in one forward of the experiment's model, and its gradients."""
    cfg = load_experiment("quickstart", [*RBF, *overrides])
    model = build_model(cfg.model, seed=0)
    checkpoint_activations(model, cfg)
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    saved = saved_bytes(model, lambda: model(x).square().mean())
    model(x).square().mean().backward()
    return saved, [p.grad.clone() for p in model.parameters()]


def test_checkpointed_layers_keep_a_tenth_of_the_activations_and_the_same_gradients():
    kept, grads = step_of([])
    checkpointed, same = step_of(["training.activation_checkpointing=layers"])
    assert checkpointed <= kept / 10, (checkpointed, kept)
    for a, b in zip(grads, same, strict=True):
        torch.testing.assert_close(a, b)
    # every second of the three layers: the second alone is checkpointed, so some are kept
    some, _ = step_of(["training.activation_checkpointing=layers", "training.activation_checkpointing_every=2"])
    assert checkpointed < some < kept


def test_every_n_without_layers_is_refused_naming_the_fix():
    with pytest.raises((ValueError, ValidationError), match=r"set training\.activation_checkpointing=layers"):
        load_experiment("quickstart", ["training.activation_checkpointing_every=2"])


def test_a_deepspeed_files_section_is_taken_in_as_layers_or_refused():
    training = load_experiment("quickstart").training
    adoption = adopt({"activation_checkpointing": {"partition_activations": False}}, training, "ds.json")
    assert adoption.training.activation_checkpointing == "layers" and not adoption.problems
    assert adoption.adopted["training.activation_checkpointing"].startswith("ds.json: activation_checkpointing = ")
    refused = adopt({"activation_checkpointing": {"cpu_checkpointing": True}}, training, "ds.json")
    assert refused.problems and "remove cpu_checkpointing from ds.json" in refused.problems[0]
    # an experiment that says none and a file that says checkpoint: one refusal with both fixes
    said_none = load_experiment("quickstart", ["training.activation_checkpointing=none"]).training
    conflict = adopt({"activation_checkpointing": {}}, said_none, "ds.json")
    assert any("--set training.activation_checkpointing=layers" in p for p in conflict.problems), conflict.problems


def test_accelerates_fsdp_checkpointing_key_is_refused_naming_the_option():
    cfg = load_experiment("quickstart")
    launch = {"distributed_type": "MULTI_GPU", "fsdp_config": {"fsdp_activation_checkpointing": True}}
    problems = launch_config_conflicts(launch, cfg.training, "cpu", 2, model=cfg.model)
    assert any(
        "fsdp_config.fsdp_activation_checkpointing" in p and "set training.activation_checkpointing=layers" in p
        for p in problems
    ), problems


def test_the_benchmark_prints_what_checkpointing_saves_per_family():
    """scripts/bench_activation_checkpointing.py as docs/memory.md shows it, made small."""
    command = [sys.executable, str(ROOT / "scripts/bench_activation_checkpointing.py"), "--widths", "8,128,128,1"]
    command += ["--batch", "256", "--families", "rbf,bspline-fast", "--steps", "1"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=child_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {
        m.group(1): m.group(2, 3)
        for m in re.finditer(r"^\| (\S+) \|[^|]+\|[^|]+\| ([\d.,]+) / ([\d.,]+) \|", done.stdout, re.M)
    }
    kept = {family: [float(v.replace(",", "")) for v in pair] for family, pair in rows.items()}
    assert set(kept) == {"rbf", "bspline-fast"}, done.stdout
    assert kept["rbf"][1] < kept["rbf"][0] / 4  # rbf's expansions recomputed, not kept
    assert kept["bspline-fast"][1] == pytest.approx(kept["bspline-fast"][0], rel=0.05)  # nothing to gain


CHECKPOINTED = ["ddp", "fsdp1", "fsdp2", "zero0", "zero1", "zero2", "zero3", "zero3_offload", "accelerate"]


@pytest.fixture(scope="module")
def checkpointed_runs(tmp_path_factory):
    """rbf, whose layers save the most, under every 2-rank strategy with its layers checkpointed
    (and tp), beside the one-process reference without: one torchrun launch."""
    tmp = tmp_path_factory.mktemp("checkpointed")
    rbf = {"family": "rbf", "widths": [2, 16, 1], "grid": 6}

    def config(strategy: dict, **training) -> dict:
        return {**experiment("bspline", strategy, 1, str(tmp / "runs"), **training), "model": rbf}

    reference = single_losses(config({"name": "single"}))
    on = {"activation_checkpointing": "layers"}
    jobs = [{"id": key, "config": config(STRATEGIES[key], **on)} for key in CHECKPOINTED]
    jobs.append({"id": "tp", "config": config({"name": "tp"}, **on)})
    return reference, run_jobs(jobs, tmp)


@pytest.mark.slow  # one launch of ten experiments
@pytest.mark.parametrize("strategy", [*CHECKPOINTED, "tp"])
def test_losses_with_checkpointed_layers_match_the_reference_without(checkpointed_runs, strategy):
    reference, results = checkpointed_runs
    result = results[strategy]
    assert result["status"] == "ok" and result["ranks_identical"], result
    assert max_rel_diff(result["losses"], reference) <= 1e-5
