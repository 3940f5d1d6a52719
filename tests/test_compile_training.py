"""``training.compile`` in real training runs: ``model`` compiles the model, ``step`` the whole
step (forward and loss as one graph, the backward by compiled autograd where the backend allows,
the optimizer step). Both train like the eager step, under single, ddp (with gradient
accumulation), fsdp1 and fsdp2 at two real ranks; compile times are recorded apart from the step times, and the record
says what was compiled."""

import re

import pytest
import torch

from analysis.records.labels import strategy_label
from kanscale.errors import ConfigError
from strategies.experiment import parse_experiment
from strategies.loop.trainer import Trainer
from strategies.runtime.distributed import DistEnv
from tests.helpers.launch import run_jobs
from tests.helpers.parity import STRATEGIES, experiment, max_rel_diff, single_losses

# Inductor fuses and reorders the arithmetic, so compiled steps round differently, by less than
# this over 20 steps; a missing gradient rescale or an unreduced gradient is off by far more.
RTOL = 2e-4


def run(tmp_path, compile: str):
    cfg = parse_experiment(experiment("bspline", {"name": "single"}, 1, str(tmp_path), compile=compile))
    trainer = Trainer(cfg, DistEnv(), show_progress=False)
    return trainer.run(), [s.loss for s in trainer.combined]


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    return run(tmp_path_factory.mktemp("eager"), "none")


@pytest.mark.parametrize("compile", ["model", "step"])
def test_compiled_training_matches_eager_and_reports_compile_time(tmp_path, eager, compile):
    eager_record, eager_losses = eager
    record, losses = run(tmp_path, compile)
    assert eager_record.timings.compile_s is None and eager_record.compile.setting == "none"
    assert 0 < record.timings.step_mean_s < record.timings.compile_s  # compiling is not in the step times
    assert 0 < max_rel_diff(losses, eager_losses) < RTOL  # compiled, so not bitwise the eager step
    assert record.compile.setting == compile
    assert strategy_label(record) == {"model": "single+compiled", "step": "single+compiled_step"}[compile]
    assert (
        record.compile.mechanism
        == {
            "model": "torch.compile(model)",
            "step": "torch.compile(forward + loss) + compiled autograd + torch.compile(optimizer.step)",
        }[compile]
    )


@pytest.fixture(scope="module")
def distributed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compiled")
    refs = {accum: single_losses(experiment("bspline", {"name": "single"}, accum, str(tmp / "s"))) for accum in (1, 2)}
    jobs = [
        {
            "id": f"{key}/{accum}",
            "config": experiment("bspline", STRATEGIES[key], accum, str(tmp / "r"), compile="step"),
        }
        for key, accum in (("ddp", 2), ("fsdp1", 1), ("fsdp2", 1))
    ]
    return refs, run_jobs(jobs, tmp)


@pytest.mark.parametrize("job", ["ddp/2", "fsdp1/1", "fsdp2/1"])
@pytest.mark.slow  # the slow tier (make test-slow)
def test_the_compiled_step_trains_like_one_eager_process_at_two_ranks(distributed, job):
    refs, results = distributed
    result = results[job]
    assert result["status"] == "ok" and result["ranks_identical"]
    assert max_rel_diff(result["losses"], refs[int(job[-1])]) < RTOL
    assert result["compile"]["setting"] == "step" and result["timings"]["compile_s"] > 0.1


@pytest.mark.slow  # the slow tier (make test-slow): the 2-rank compiled pool
def test_fsdp_runs_its_backward_eagerly_and_says_so(distributed):
    # Compiled autograd mishandles FSDP's gradient hooks (strategies/step/compiled_step.py).
    _, results = distributed
    assert all("eager backward" in results[job]["compile"]["mechanism"] for job in ("fsdp1/1", "fsdp2/1"))
    assert "compiled autograd" in results["ddp/2"]["compile"]["mechanism"]


def test_the_old_model_compile_spelling_reads_as_training_compile_model():
    cfg = experiment("bspline", {"name": "single"}, 1, "runs")
    old = {**cfg, "model": {**cfg["model"], "compile": True}}
    assert parse_experiment(old).training.compile == "model"
    assert parse_experiment({**cfg, "model": {**cfg["model"], "compile": False}}).training.compile == "none"
    with pytest.raises(ConfigError, match=re.escape("model.compile: true contradicts training.compile: step")):
        parse_experiment({**old, "training": {**cfg["training"], "compile": "step"}})


@pytest.mark.parametrize("compile", ["model", "step"])
def test_a_short_last_batch_does_not_compile_again(compile):
    # An epoch's last batch is short; compiling again would land inside a timed window.
    from torch._dynamo.utils import counters

    from kan_models import build_model, parse_model_config
    from kan_models.compile import compile_model
    from strategies.sections import TrainingConfig
    from strategies.step.engine import Engine
    from strategies.step.optim import build_optimizer

    model = build_model(parse_model_config({"family": "bspline", "widths": [2, 8, 1], "grid": 5}), 0)
    training = TrainingConfig(compile=compile, steps=4)
    batches = [torch.rand(n, 2) for n in (256, 256, 40, 256, 40)]
    if compile == "model":
        compile_model(model, batches[0])
    engine = Engine(model, build_optimizer(model.parameters(), training), training)
    compiled = []
    for x in batches:
        engine.forward_backward([(x, x.square().sum(1, keepdim=True))], lambda out, y: (out - y).square().sum(), len(x))
        engine.step()
        compiled.append((counters["frames"]["ok"], counters["compiled_autograd"]["captures"]))
    assert compiled[0][0] > 0
    assert compiled[-1] == compiled[1], f"compiled again after the first steps: {compiled}"
