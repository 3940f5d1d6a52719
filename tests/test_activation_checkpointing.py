"""training.activation_checkpointing: the layers keep no activations but recompute them, the
arithmetic stays the same under every strategy (two real ranks), and users' native files are
read into the same option or refused, naming the key."""

from __future__ import annotations

import itertools
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
    """The bytes one forward of the experiment's model keeps for backward (a checkpointed unit's
    inputs in place of what it saves), and its gradients."""
    cfg = load_experiment("quickstart", [*RBF, *overrides])
    model = build_model(cfg.model, seed=0)
    units = checkpoint_activations(model, cfg)
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    saved = saved_bytes(model, lambda: model(x).square().mean(), units)
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


@pytest.mark.parametrize("compile", ["model", "step"])
def test_compiling_checkpointed_layers_is_refused_naming_both_fixes(compile):
    """torch.compile with the composable checkpoint fails in the first backward (CheckpointError: other
    tensors saved in the recomputation), after the launch: refused before it, and each fix parses."""
    both = [f"training.compile={compile}", "training.activation_checkpointing=layers"]
    fixes = re.escape("set training.compile=none, or training.activation_checkpointing=none")
    with pytest.raises((ValueError, ValidationError), match=fixes):
        load_experiment("quickstart", both)
    for fix in ("training.compile=none", "training.activation_checkpointing=none"):
        assert load_experiment("quickstart", [*both, fix]).training.compile in (compile, "none")
    # a DeepSpeed file's section that would turn checkpointing on under compile is refused too
    compiled = load_experiment("quickstart", [f"training.compile={compile}"]).training
    refused = adopt({"activation_checkpointing": {}}, compiled, "ds.json")
    assert any("set training.compile=none" in p for p in refused.problems), refused.problems


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
    assert result["memory"]["activation_checkpointing"] == "layers" and result["memory"]["checkpointed_units"] == 2


# The issue's model at 2048 samples per rank, and a user's own (examples/my_kan.py)
LARGE = {
    "rbf": {"family": "rbf", "widths": [32, 512, 512, 512, 1]},
    "custom": {
        "family": "custom",
        "widths": [32, 1],
        "factory": "examples/my_kan.py:build",
        "options": {"hidden": [256, 256]},
    },
}
RECORDED = {("rbf", s) for s in ("ddp", "fsdp2", "zero3")} | {("custom", "ddp")}


@pytest.fixture(scope="module")
def recorded_runs(tmp_path_factory):
    """Each of RECORDED without and with checkpointed layers, at 2 ranks: one torchrun launch."""
    tmp = tmp_path_factory.mktemp("recorded")
    jobs = []
    for (model, strategy), mode in itertools.product(sorted(RECORDED), ("none", "layers")):
        config = experiment("bspline", STRATEGIES[strategy], 1, str(tmp / "runs"), activation_checkpointing=mode)
        # the last warm-up step is counted: the third, after DDP has rebuilt its buckets (in the second)
        config["training"].update(micro_batch=2048, global_batch=None, steps=4, warmup_steps=3, seed=0)
        config["task"] = {"name": "high_dim", "dim": 32, "n_train": 4096, "n_test": 64}
        config.update(model=LARGE[model], measurement={"baseline": "off"})
        jobs.append({"id": f"{model}-{strategy}-{mode}", "config": config})
    return run_jobs(jobs, tmp)


@pytest.mark.slow  # one launch of eight experiments of a few million parameters
@pytest.mark.parametrize(("model", "strategy"), sorted(RECORDED))
def test_records_show_a_tenth_of_the_activations_with_checkpointing_and_equal_losses(recorded_runs, model, strategy):
    without, with_ = (recorded_runs[f"{model}-{strategy}-{mode}"] for mode in ("none", "layers"))
    assert without["status"] == with_["status"] == "ok"
    assert max_rel_diff(with_["losses"], without["losses"], steps=4) <= 1e-5
    kept, checkpointed = (r["memory"]["activations_after_forward_bytes"] for r in (without, with_))
    assert 0 < checkpointed <= kept / 10, (kept, checkpointed)
    assert with_["memory"]["step_peak"]["peak"] < without["memory"]["step_peak"]["peak"]
    # the recomputation is the hardware's, not the model's: the model's FLOPs stay what they were
    assert with_["flops"]["model_per_sample"] == pytest.approx(without["flops"]["model_per_sample"], rel=1e-6)
    # (elementwise work counts nothing: my_kan's recomputed bases add no FLOPs, its products few)
    assert with_["flops"]["hardware_per_sample"] > without["flops"]["hardware_per_sample"]
