"""Tensor parallelism (``tp``) and 2-D FSDP2 x TP (``fsdp2_tp``) on real gloo process groups:
per-step losses match the one-process reference for the B-spline, RBF and Chebyshev families,
with grid updates too; a failed run resumes bit for bit from its DCP checkpoint, which exports
to the whole model; model-state bytes per rank fall by the TP degree."""

import itertools
import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from analysis.projection import tp_exchanges
from analysis.records.run_files import read_summary
from kan_models import build_model
from launchers.summary import format_summary
from launchers.zoo import model_shape
from strategies.backends.tp_plan import FEATURES, layer_plans
from strategies.experiment import parse_experiment
from strategies.loop.trainer import Trainer
from tests.helpers.launch import ROOT, run, run_here, run_jobs
from tests.helpers.parity import max_rel_diff

MODELS = {
    # three layers: a Megatron pair, then a row-split output layer
    "bspline": {"family": "bspline", "widths": [2, 8, 4, 1], "grid": 5, "grid_range": [-2.0, 2.0]},
    # its LayerNorm needs whole inputs: colwise with the output gathered, then a whole output layer
    "rbf": {"family": "rbf", "widths": [2, 8, 1]},
    # without it the pair forms, and the base path's bias is added once after the row split's sum
    "rbf_plain": {"family": "rbf", "widths": [2, 8, 4, 1], "layernorm": False},
    "chebyshev": {"family": "chebyshev", "widths": [2, 8, 1]},
}
STEPS = 10
RTOL = 1e-5  # a gradient off by the TP degree shows on the first steps far above this


def experiment(family: str, strategy: dict, out: Path, **training) -> dict:
    return {
        "name": f"tp_{family}",
        "model": MODELS[family],
        "task": {"name": "quadratic", "n_train": 640, "n_test": 96},
        "training": {
            "seed": 3,
            "lr": 5e-2,
            "micro_batch": None,
            "global_batch": 64,
            "steps": STEPS,
            "warmup_steps": 1,
            "grad_clip": 2.0,
            **training,
        },
        "strategy": strategy,
        "measurement": {"baseline_steps": 1},
        "runtime": {"device": "cpu", "threads": 1},
        "output": {"dir": str(out)},
    }


GRID = {"grid_update_every": 3, "grid_update_until": 7}


def jobs_for(strategy: dict, tmp: Path) -> list[dict]:
    jobs = [{"id": family, "config": experiment(family, strategy, tmp / "runs")} for family in MODELS]
    jobs.append({"id": "grid", "config": experiment("bspline", strategy, tmp / "runs", **GRID)})
    resumable = experiment("chebyshev", strategy, tmp / "resume", steps=12, checkpoint_every=4)  # the last at the end
    jobs += [
        {"id": "full", "config": resumable},
        {"id": "failed", "config": {**resumable, "fault": {"rank": "all", "step": 7, "kind": "exception"}}},
        {"id": "resumed", "config": resumable, "resume": True},
        {"id": "export", "export": "full", "to": str(tmp / "exported.pt")},
    ]
    return jobs


def single(family: str, tmp: Path, **training) -> Trainer:
    return run_here(experiment(family, {"name": "single"}, tmp / "single", **training))


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp_single")
    trainers = {family: single(family, tmp) for family in MODELS}
    trainers["grid"] = single("bspline", tmp, **GRID)
    return {key: ([s.loss for s in t.combined], t.engine.model_state_bytes()) for key, t in trainers.items()}


@pytest.fixture(scope="module")
def tp_world2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp2")
    jobs = jobs_for({"name": "tp"}, tmp)
    jobs.append({"id": "colwise", "config": experiment("bspline", {"name": "tp", "plan": "colwise"}, tmp / "runs")})
    jobs.append(
        {"id": "fsdp2", "config": experiment("bspline", {"name": "fsdp2", "shard_largest_dim": False}, tmp / "runs")}
    )
    return tmp, run_jobs(jobs, tmp, nproc=2)


@pytest.fixture(scope="module")
def fsdp2_tp_world4(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp4")
    jobs = jobs_for({"name": "fsdp2_tp", "tp_degree": 2}, tmp)
    jobs.append({"id": "tp4", "config": experiment("bspline", {"name": "tp"}, tmp / "runs")})  # one replica over 4
    checkpointed = experiment(
        "bspline", {"name": "fsdp2_tp", "tp_degree": 2}, tmp / "runs", activation_checkpointing="layers"
    )
    jobs.append({"id": "checkpointed", "config": checkpointed})  # the layers wrapped before TP cuts them
    return tmp, run_jobs(jobs, tmp, nproc=4)


@pytest.fixture(params=["tp_world2", "fsdp2_tp_world4"])
def launched(request):
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("key", [*MODELS, "grid"])
def test_losses_match_the_single_process_reference(launched, references, key):
    _, results = launched
    result = results[key]
    assert result["status"] == "ok" and result["ranks_identical"]
    reference = references[key][0]
    assert reference[-1] < 0.8 * reference[0]  # it trained
    assert max_rel_diff(result["losses"], reference, STEPS) < RTOL


def test_a_failed_run_resumes_bit_for_bit_and_its_checkpoint_exports_the_whole_model(launched):
    tmp, results = launched
    full, failed, resumed = results["full"], results["failed"], results["resumed"]
    assert failed["status"] == "raised" and "injected fault" in failed["error"]
    assert resumed["status"] == "ok" and resumed["resumed_at_steps"] == [4]
    assert resumed["losses"] == full["losses"] and resumed["ranks_identical"]
    # The exported whole model, evaluated in this one process, scores what the run recorded.
    exported = torch.load(tmp / "exported.pt", weights_only=False)
    assert exported["source"]["format"] == "dcp" and exported["source"]["step"] == 12
    cfg = parse_experiment(experiment("chebyshev", {"name": "single"}, tmp))
    model = build_model(cfg.model, 0)
    model.load_state_dict(exported["model_state"])
    data = cfg.task.generate(cfg.training.seed)
    with torch.no_grad():
        mse = float((model(data.x_test.float()) - data.y_test.float()).double().pow(2).mean())
    assert mse == pytest.approx(full["test_metrics"]["mse"], rel=1e-5)


def test_model_state_per_rank_falls_by_the_tp_degree(tp_world2, fsdp2_tp_world4, references):
    """Every tensor of the bspline model is cut: TP over 2 ranks holds exactly half of each of
    parameters and gradients; on 2 x 2, FSDP2 halves that again (within its padding of the
    one-output layer's dim 0, which it cannot split in two)."""
    single_state = references["bspline"][1]
    tp = tp_world2[1]["bspline"]["model_state"]
    assert tp["params"] * 2 == single_state.params
    assert tp["grads"] == tp["params"]  # counted at the step, when every gradient exists
    adam_steps = 4 * 3 * (len(MODELS["bspline"]["widths"]) - 1)  # Adam's step counters (a float per tensor): not cut
    assert tp["optimizer"] - adam_steps == (single_state.optimizer - adam_steps) / 2
    fsdp2 = tp_world2[1]["fsdp2"]["model_state"]
    two_d = fsdp2_tp_world4[1]["bspline"]["model_state"]
    assert two_d["params"] < fsdp2["params"] * 0.6 and two_d["params"] < tp["params"] * 0.6


def test_the_colwise_plan_gathers_between_layers_and_keeps_parity(tp_world2, references):
    result = tp_world2[1]["colwise"]
    assert result["status"] == "ok" and max_rel_diff(result["losses"], references["bspline"][0], STEPS) < RTOL


def test_tp_over_four_ranks_keeps_parity_and_quarters_the_state(fsdp2_tp_world4, references):
    result = fsdp2_tp_world4[1]["tp4"]
    assert result["status"] == "ok" and result["ranks_identical"]
    assert max_rel_diff(result["losses"], references["bspline"][0], STEPS) < RTOL
    assert result["model_state"]["params"] * 4 == references["bspline"][1].params


def test_checkpointed_layers_under_fsdp2_x_tp_keep_parity(fsdp2_tp_world4, references):
    result = fsdp2_tp_world4[1]["checkpointed"]
    assert result["status"] == "ok" and result["ranks_identical"]
    assert max_rel_diff(result["losses"], references["bspline"][0], STEPS) < RTOL
    assert result["memory"]["activation_checkpointing"] == "layers"
    assert result["memory"]["checkpointed_units"] == len(MODELS["bspline"]["widths"]) - 1


def test_the_record_says_how_each_layer_was_cut(tp_world2):
    _tmp, results = tp_world2
    summary = json.loads((Path(results["bspline"]["run_dir"]) / "summary.json").read_text())
    assert summary["strategy"]["backend_config"] == {
        "mesh": {"dp": 1, "tp": 2},
        "layers": ["colwise", "rowwise", "rowwise"],
    }
    assert summary["batch"]["global_batch"] == 64 and summary["topology"]["world_size"] == 2
    run_dir = Path(results["bspline"]["run_dir"])
    printed = format_summary(read_summary(run_dir / "summary.json"), run_dir)
    assert "global batch 64 (micro 64 x accum 1 x 1 data-parallel rank(s) of 2 tensor-parallel ranks each)" in printed


@pytest.mark.parametrize(
    "plan, widths, expected",
    [
        ("pairs", [2, 8, 4, 1], ["colwise", "rowwise", "rowwise"]),
        ("pairs", [2, 8, 8, 8, 1], ["colwise", "rowwise", "colwise", "rowwise"]),
        ("pairs", [3, 5, 1], ["whole", "whole"]),  # the TP degree divides no width
        ("colwise", [2, 8, 4, 1], ["colwise", "colwise", "rowwise"]),  # one output: the last layer takes the rows
        ("rowwise", [2, 8, 4, 1], ["rowwise", "rowwise", "rowwise"]),
    ],
)
def test_layer_plans(plan, widths, expected):
    model = (
        parse_experiment(experiment("bspline", {"name": "single"}, Path("runs")))
        .model.model_copy(update={"widths": widths})
        .sketch()
    )
    plans = layer_plans(model.blocks, 2, plan)
    assert [p.split for p in plans] == expected
    # A colwise layer hands its shard to a rowwise successor directly; everything else is whole.
    for before, after in itertools.pairwise(plans):
        assert before.hands_on == after.receives
        assert (before.hands_on == FEATURES) == (before.split == "colwise" and after.split == "rowwise")


def test_a_step_issues_the_collectives_the_projection_counts(tmp_path):
    """DTensor's CommDebugMode counts what one real forward and backward exchange at TP degree 2;
    the projection, from the widths alone, expects the same: per pair one all-reduce forward and
    one backward (none into the model's input), a left-over rowwise layer one all-reduce forward
    and one all-gather backward."""
    models = {
        "pair, then rowwise": MODELS["bspline"],
        "chebyshev pair": MODELS["chebyshev"],
        "two pairs": {**MODELS["bspline"], "widths": [2, 8, 8, 8, 1]},
        "rbf, no norm": MODELS["rbf_plain"],
    }
    (tmp_path / "models.json").write_text(json.dumps(models))
    run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(ROOT / "tests/helpers/tp_collectives.py"),
            str(tmp_path / "models.json"),
            str(tmp_path / "counts.json"),
        ]
    )
    measured = json.loads((tmp_path / "counts.json").read_text())
    for name, config in models.items():
        plan = tp_exchanges(model_shape(config), samples=16)
        expected = {
            pass_: dict(Counter(e.op for e in exchanges if e is not None))
            for pass_, exchanges in zip(("forward", "backward"), zip(*plan, strict=True), strict=True)
        }
        assert measured[name] == expected, name
    assert measured["two pairs"] == {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 1}}


def test_the_rehearsal_counts_the_collectives_each_run_records(tp_world2, fsdp2_tp_world4, tmp_path):
    """DTensor's collectives (functional ops) are counted like the other backends' c10d ones: the
    rehearsal at the run's layout issues, per step, the collectives and bytes the run recorded."""
    from launchers.rehearse import RehearsalRequest, rehearsal_children, rehearse_in_child
    from strategies.rehearsal.result import Rehearsal

    fields = ("intra_node_bytes", "inter_node_bytes", "intra_node_collectives", "inter_node_collectives")
    for (_tmp, results), strategy, ranks in (
        (tp_world2, {"name": "tp"}, 2),
        (fsdp2_tp_world4, {"name": "fsdp2_tp", "tp_degree": 2}, 4),
    ):
        recorded = read_summary(Path(results["bspline"]["run_dir"]) / "summary.json").comm_bytes
        config = tmp_path / f"{strategy['name']}.yaml"
        config.write_text(json.dumps(experiment("bspline", strategy, tmp_path / "o")))
        request = RehearsalRequest(str(config), [], strategy["name"], 1, ranks, 0, None)
        with rehearsal_children():
            rehearsed = rehearse_in_child(request, strategy["name"], tmp_path / f"{strategy['name']}.json")
        assert isinstance(rehearsed, Rehearsal), rehearsed
        assert recorded is not None and recorded.intra_node_collectives > 0, strategy
        assert rehearsed.comm is not None
        assert {f: getattr(rehearsed.comm, f) for f in fields} == {f: getattr(recorded, f) for f in fields}, strategy
