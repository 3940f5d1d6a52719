"""Ranks sharing this machine's cores: commbench's measurement read at a step's compute length, and
recommend's prediction on this machine slowed by it (or by ``--contention`` where given)."""

import json
import math

import pytest

from analysis import projection as pj
from analysis.projection.memory import StepMemory
from analysis.projection.shared_cores import shared_cores_at
from launchers.recommend.advise import RecommendRequest, advise, candidate_strategies
from launchers.recommend.probe import Probe
from launchers.zoo import model_shape
from strategies.experiment import load_experiment

MEASURED = pj.ComputeProfile("hand-made", samples=512, compute_s=0.004, data_s=1e-4)  # 4 ms at 256 per rank
SMALL = ["model.widths=[8,64,64,1]", "model.grid_range=[-1,1]", "task.name=high_dim", "task.dim=8"]


def row(compute_s: float, factor: float) -> dict[str, float]:
    return {
        "compute_s": compute_s,
        "together_s": factor * compute_s,
        "factor": factor,
        "factor_low": factor - 0.1,
        "factor_high": factor + 0.2,
        "iters": 15,
    }


SHARED = [row(1e-3, 2.0), row(4e-3, 1.5), row(16e-3, 1.2)]


def test_the_factor_is_read_at_the_steps_compute_length():
    docs = [{"shared_cores": SHARED}]
    assert shared_cores_at(docs, 4e-3).factor == pytest.approx(1.5)
    at_2ms = shared_cores_at(docs, 2e-3)  # halfway between 1 and 4 ms in log(seconds)
    assert (at_2ms.factor, at_2ms.low, at_2ms.high) == pytest.approx((1.75, 1.65, 1.95))
    # outside what was measured: held at the ends, never extrapolated
    assert shared_cores_at(docs, 1e-5).factor == pytest.approx(2.0)
    assert shared_cores_at(docs, 10.0).factor == pytest.approx(1.2)
    assert shared_cores_at([{"fits": []}], 4e-3) is None  # a GPU's or an older file: nothing measured


def recommend(tmp_path, shared, **flags):
    fits = [
        {"link": "intra", "op": op, "link_alpha_s": 50e-6, "link_beta_s_per_byte": 1e-9}
        for op in ("all_reduce", "reduce_scatter", "all_gather")
    ]
    bench = tmp_path / "commbench.json"
    doc = {"kind": "kanscale commbench", "fits": fits, "ranks_per_node": 2, "device": "cpu"}
    bench.write_text(json.dumps({**doc, "shared_cores": shared} if shared else doc))
    r = RecommendRequest("quickstart", SMALL, network=[str(bench)], nproc_per_node=2, strategies="ddp", **flags)
    cfg = load_experiment("quickstart", SMALL)
    shape = model_shape(cfg.model.model_dump())
    models, excluded = candidate_strategies(r, cfg, 2, 2, shape)
    memory = StepMemory("hand-made", fixed=1e6, per_sample=1e3)
    labels = ["single", "*", "ddp"]
    probe = Probe(dict.fromkeys(labels, MEASURED), dict.fromkeys(labels, memory), {}, memory, 256, tmp_path / "none")
    return advise(r, cfg, shape, models, excluded, probe, None)


def test_recommend_here_slows_compute_by_what_commbench_measured(tmp_path):
    alone = recommend(tmp_path, None, contention=1.0)
    shared = recommend(tmp_path, SHARED)
    (one,), (two,) = alone.candidates, shared.candidates
    # the step computes 2 ms per rank (256 of 512 samples): 1.75x there, its range the ends
    assert shared.target.contention == pytest.approx(1.75)
    assert shared.target.at("slow").contention == pytest.approx(1.95)
    assert shared.target.at("fast").contention == pytest.approx(1.65)
    assert two.samples_per_s < one.samples_per_s
    assert two.samples_per_s_low < two.samples_per_s < two.samples_per_s_high
    assert any("x1.75 [1.65-1.95] when 2 ranks share this machine's cores at 2 ms" in a for a in shared.assumptions)
    # --contention, where given, is what it uses; a file without the measurement says it assumed 1
    given = recommend(tmp_path, SHARED, contention=1.3)
    assert given.target.contention == 1.3
    assert any("x1.3 when ranks share the machine (--contention)" in a for a in given.assumptions)
    unmeasured = recommend(tmp_path, None)
    assert unmeasured.target.contention == 1.0
    assert any("commbench file does not measure it; delete it to measure again" in a for a in unmeasured.assumptions)
    assert math.isclose(unmeasured.candidates[0].samples_per_s, one.samples_per_s)
