"""recommend counts activations per sample by the experiment's checkpointing mode and precision,
and says when a batch would fit in fewer micro-batches (or fit at all) with checkpointing, at
what estimated cost (launchers/recommend/checkpointing.py)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from analysis import projection as pj
from analysis.projection.advice import Target, lay_out
from analysis.projection.memory import peak_memory
from launchers.recommend.checkpointing import checkpointed, checkpointing_lines, recompute_cost
from launchers.recommend.probe import device_step_memory
from launchers.zoo import model_shape
from strategies.experiment import load_experiment
from tests.test_recommend import network

RBF = ["model.family=rbf", "model.widths=[32,256,256,1]", "task.name=high_dim", "task.dim=32"]


def per_sample(*overrides: str) -> float:
    return device_step_memory(load_experiment("quickstart", [*RBF, *overrides]), 256).per_sample


def test_the_probe_counts_activations_by_checkpointing_mode_and_precision():
    kept = per_sample()
    assert per_sample("training.activation_checkpointing=layers") < kept / 5  # each layer's input alone
    # under bf16 autocast a product's input is kept twice: in float32 for the elementwise work
    # beside it, and its bfloat16 copy for the product's backward (measured: ~13% more here)
    bf16 = device_step_memory(load_experiment("quickstart", [*RBF, "training.precision=bf16"]), 256)
    assert kept < bf16.per_sample < 2 * kept and "bf16" in bf16.source


def test_a_batch_that_fits_only_in_more_micro_batches_is_told_what_checkpointing_would_do():
    cfg = load_experiment("quickstart", RBF)
    shape = replace(model_shape(cfg.model.model_dump()), precision="fp32")
    ddp = load_experiment("quickstart", [*RBF, "strategy.name=ddp"]).strategy.cost_model()
    profile = {"value": pj.ComputeProfile("test", samples=256, compute_s=0.01)}
    beside = device_step_memory(cfg, 256)
    # room for 300 samples a rank without checkpointing: the 512 of each rank in two micro-batches
    memory = peak_memory(ddp, shape, 2, 300, beside, True).total
    target = Target(name="test", nodes=1, ranks_per_node=2, memory_per_rank=memory, network=network())

    def lay_out_with(per_sample: float):
        return lay_out(ddp, shape, profile, replace(beside, per_sample=per_sample), target, 1024)

    without = lay_out_with(beside.per_sample)
    assert without.fits and without.grad_accum == 2
    lines = checkpointing_lines(cfg, 256, [without], lambda c, per_sample: lay_out_with(per_sample))
    assert len(lines) == 1 and lines[0].startswith("ddp: with --set training.activation_checkpointing=layers")
    assert "fits in 1 micro-batch(es) of 512 samples per rank (without: 2 micro-batches of 256)" in lines[0]
    cost = recompute_cost(cfg, 256)
    assert 1.05 < cost < 2.0 and f"x{cost:.2f}" in lines[0]  # up to one more forward
    # a compiled experiment is told to run eager too (the two are refused together), and that parses
    compiled = load_experiment("quickstart", [*RBF, "training.compile=model"])
    (line,) = checkpointing_lines(compiled, 256, [without], lambda c, per_sample: lay_out_with(per_sample))
    sets = re.findall(r"--set (\S+)", line)
    assert sets == ["training.activation_checkpointing=layers", "training.compile=none"]
    assert load_experiment("quickstart", [*RBF, "training.compile=model", *sets]).training.compile == "none"
    # an experiment that checkpoints already, or a batch that fits whole, is told nothing
    assert checkpointing_lines(checkpointed(cfg), 256, [without], lambda c, p: lay_out_with(p)) == []
    roomy = replace(without, grad_accum=1)
    assert checkpointing_lines(cfg, 256, [roomy], lambda c, p: pytest.fail("laid out again")) == []
