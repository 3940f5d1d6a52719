"""``training.loader: dataloader``: a torch DataLoader with a DistributedSampler and worker
processes instead of in-memory indexing. Parity with its own one-process run (the sampler's order
is the same for every world size), resume mid-epoch, data time reported, and the analysis keeps
the two data paths apart. Two real ranks on gloo, real worker processes."""

from pathlib import Path

import pytest

from analysis.records.run_files import read_summary
from strategies.experiment import parse_experiment
from strategies.loop.trainer import Trainer
from strategies.runtime.distributed import DistEnv
from tests.helpers.launch import run_jobs
from tests.helpers.parity import STRATEGIES, max_rel_diff

STEPS = 14  # 640 samples, global batch 64: an epoch boundary at step 10, inside the run
MODEL = {"family": "bspline", "widths": [2, 8, 1], "grid": 5, "grid_range": [-2.0, 2.0]}


def experiment(out: Path, strategy: dict | None = None, **training) -> dict:
    return {
        "name": "loader",
        "model": MODEL,
        "task": {"name": "quadratic", "n_train": 640, "n_test": 128},
        "training": {
            "seed": 2,
            "lr": 1e-2,
            "micro_batch": None,
            "global_batch": 64,
            "steps": STEPS,
            "warmup_steps": 2,
            "loader": "dataloader",
            "loader_workers": 2,
            **training,
        },
        "strategy": strategy or {"name": "single"},
        "measurement": {"baseline_steps": 1, "window_steps": 3},
        "runtime": {"device": "cpu", "threads": 1},
        "output": {"dir": str(out)},
    }


def single(cfg: dict) -> tuple[list[float], object]:
    trainer = Trainer(parse_experiment(cfg), DistEnv(), show_progress=False)
    record = trainer.run()
    return [s.loss for s in trainer.combined], record


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("loader")
    refs = {accum: single(experiment(tmp / "s", grad_accum=accum)) for accum in (1, 2)}
    refs["memory"] = single(experiment(tmp / "s", loader="memory"))
    jobs = [
        {"id": f"{key}/{accum}", "config": experiment(tmp / "r", STRATEGIES[key], grad_accum=accum)}
        for key in ("ddp", "fsdp2", "zero2")
        for accum in (1, 2)
    ]
    resumable = experiment(tmp / "resume", STRATEGIES["ddp"], checkpoint_every=6)
    jobs += [
        {"id": "full", "config": resumable},
        {"id": "failed", "config": {**resumable, "fault": {"rank": "all", "step": 9, "kind": "exception"}}},
        {"id": "resumed", "config": resumable, "resume": True},
    ]
    return refs, run_jobs(jobs, tmp)


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "zero2"])
def test_the_dataloader_path_has_parity_with_its_one_process_run(runs, strategy, accum):
    refs, results = runs
    result = results[f"{strategy}/{accum}"]
    assert result["status"] == "ok" and result["ranks_identical"]
    reference = refs[accum][0]
    assert max_rel_diff(result["losses"], reference, STEPS) < 1e-5
    assert reference[-1] < reference[0]  # it trained


def test_the_sampler_orders_samples_otherwise_than_the_suites_split(runs):
    refs, _ = runs
    loader, memory = refs[1][0], refs["memory"][0]
    assert abs(loader[0] - memory[0]) / memory[0] > 1e-3  # different samples from step 1 on (docs)


def test_a_run_resumed_mid_epoch_takes_up_the_samplers_order_where_it_stopped(runs):
    _, results = runs
    assert results["failed"]["status"] == "raised" and results["resumed"]["resumed_at_steps"] == [6]
    assert results["resumed"]["losses"] == results["full"]["losses"]


def test_the_record_says_the_data_path_and_its_data_time(runs):
    refs, results = runs
    loader, memory = refs[1][1], refs["memory"][1]
    assert (loader.batch.loader, loader.batch.loader_workers) == ("dataloader", 2)
    assert (memory.batch.loader, memory.batch.loader_workers) == ("memory", 0)
    # waiting for worker processes' batches costs more than indexing a tensor, and is not counted as communication
    assert loader.timings.data_s > memory.timings.data_s > 0
    ddp = read_summary(Path(results["ddp/1"]["run_dir"]))
    assert ddp.timings.data_s > 0 and ddp.batch.loader == "dataloader"


def test_classification_labels_go_through_the_workers(tmp_path):
    cfg = experiment(tmp_path)
    cfg["model"] = {"family": "bspline", "widths": [64, 16, 10], "grid": 4}
    cfg["task"] = {"name": "sklearn", "dataset": "digits"}
    cfg["training"].update(steps=None, epochs=3, loader_workers=1)
    losses, record = single(cfg)
    assert record.status == "ok" and record.task.goal == "classification" and losses[-1] < losses[0]
    assert 0.0 <= record.test_metrics["accuracy"] <= 1.0
