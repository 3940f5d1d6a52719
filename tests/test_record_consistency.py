"""analyze compares like with like: a record that contradicts itself (edited by hand: its world size
against its nodes, its mesh or its per-rank rate, its global batch against its micro-batches) is
kept out of every comparison and named, with the reason, among the report's problems; the run
beside it is analysed as before."""

import json
import shutil

import pytest

from analysis.records.load import load_runs
from launchers.cli import main

SHORT = ["--strategy", "single", "--set", "training.steps=3", "--set", "training.warmup_steps=1", "--no-progress"]


def edit(doc: dict, change: dict) -> None:
    for key, value in change.items():
        *parents, last = key.split(".")
        node = doc
        for p in parents:
            node = node[p]
        node[last] = value


@pytest.mark.parametrize(
    "change, says",
    [
        ({"topology.world_size": 4}, "world_size 4 is not nodes x procs_per_node (1 x 1)"),
        ({"topology.mesh": {"dp_replicate": 2, "dp_shard": 1, "tp": 1}}, "holds 2 ranks, its world_size is 1"),
        ({"batch.global_batch": 1024}, "global_batch 1024 is not micro_batch x grad_accum x data-parallel ranks"),
        ({"throughput.samples_per_s_per_rank": 1.0}, "is not samples_per_s_per_rank x world_size"),
    ],
)
def test_a_record_that_contradicts_itself_is_kept_out_and_named(tmp_path, capsys, change, says):
    runs = tmp_path / "runs"
    assert main(["train", "quickstart", *SHORT, "--out", str(runs)]) == 0
    (good,) = list(runs.iterdir())
    edited = runs / "edited"
    shutil.copytree(good, edited)
    summary = edited / "summary.json"
    doc = json.loads(summary.read_text())
    edit(doc, change)
    summary.write_text(json.dumps(doc))
    rows, problems = load_runs(runs)
    assert list(rows["run_dir"]) == [str(good)]
    (problem,) = problems
    assert problem.path == summary and says in problem.message
    capsys.readouterr()
    assert main(["analyze", str(runs)]) == 0
    assert "contradicts itself" in (runs / "report" / "report.html").read_text()


def test_a_run_id_names_the_model_it_trained():
    """One experiment file trains many models (``--set model...``): the run's name says which."""
    from strategies.experiment import ExperimentConfig
    from strategies.measure.record import NAME_BYTES, new_run_id

    task = {"name": "high_dim", "dim": 64}
    base = {"name": "quickstart", "task": task, "model": {"family": "chebyshev", "widths": [64, 128, 1], "degree": 8}}
    assert new_run_id(ExperimentConfig.model_validate(base), 2).startswith("quickstart-chebyshev-64x128x1-single-p2-")
    named = {**base, "name": "chebyshev-digits"}
    assert new_run_id(ExperimentConfig.model_validate(named), 1).startswith("chebyshev-digits-64x128x1-single-p1-")
    deep = {"name": "n" * 200, "task": task, "model": {"family": "bspline", "widths": [64] + [4096] * 9 + [1]}}
    run_id = new_run_id(ExperimentConfig.model_validate(deep), 8)
    assert len(run_id) <= NAME_BYTES and "-bspline-64x1-10layers-single-p8-" in run_id
