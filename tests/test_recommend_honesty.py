"""kanscale recommend's honest output (issue 45, point 4), through its functions with a hand-made
probe in place of the 1-rank runs: every cluster-file number may carry its range, and the
predicted interval is the rate with every input at its pessimistic and its optimistic end;
overlapping picks share their rank; a model one device trains as fast is told so; search limits
are reported as found or as "beyond"; every row names the bound of its step; several NICs per
node carry the inter-node bytes together."""

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from analysis import projection as pj
from analysis.projection.advice import Target, lay_out, measured_ends, one_device_verdict, ranked
from analysis.projection.memory import StepMemory
from analysis.projection.step_model import Scenario, project_step
from kanscale.errors import ConfigError
from launchers.recommend.advise import Recommendation, RecommendRequest, advise, candidate_strategies, layout
from launchers.recommend.probe import Probe
from launchers.recommend.report import document, limit, markdown
from launchers.recommend.step_ops import count_step_ops
from launchers.recommend.target import device_profile, read_cluster
from launchers.recommend.widths import WIDTHS_CAP, largest_widths
from launchers.zoo import model_shape
from strategies.experiment import load_experiment
from tests.helpers.launch import ROOT

CLUSTER = ROOT / "configs/clusters/a100_ib.yaml"
PAPER = str(ROOT / "configs/experiments/paper_kan64.yaml")
MEASURED = pj.ComputeProfile("hand-made", samples=512, compute_s=0.05, data_s=1e-4)  # a probe's, by hand
SMALL = ["model.widths=[8,64,64,1]", "model.grid_range=[-1,1]", "task.name=high_dim", "task.dim=8"]


def cluster_file(tmp_path: Path, change: dict) -> str:
    """a100_ib.yaml with ``change`` applied: dotted keys into the document, None deletes."""
    doc = yaml.safe_load(CLUSTER.read_text())
    for key, value in change.items():
        *parents, last = key.split(".")
        where = doc
        for p in parents:
            where = where[p]
        if value is None:
            del where[last]
        else:
            where[last] = value
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def recommendation(tmp_path: Path, config: str, overrides: list[str], cluster: str, **flags) -> Recommendation:
    """``kanscale recommend`` from its probe on: a hand-made 1-rank profile and memory for every
    strategy (no runs, so no spread between timing windows), the rest as the command runs it."""
    r = RecommendRequest(config, overrides, cluster=cluster, out=str(tmp_path / "rec"), **flags)
    cfg = load_experiment(r.config, r.overrides)
    file = read_cluster(cluster, None)
    shape = replace(model_shape(cfg.model.model_dump()), precision=cfg.training.precision)
    per_node, ranks = layout(r, file)
    models, excluded = candidate_strategies(r, cfg, ranks, per_node, shape)
    memory = StepMemory("hand-made", fixed=1e6, per_sample=1e3)
    labels = ["single", "*", *(m.label for m in models.values())]
    probe = Probe(dict.fromkeys(labels, MEASURED), dict.fromkeys(labels, memory), {}, memory, 512, tmp_path / "no-runs")
    return advise(r, cfg, shape, models, excluded, probe, file)


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("device_tflops", {"value": 13, "low": 14, "high": 20}, "low <= value <= high"),
        ("memory_bandwidth_GBps", float("inf"), "finite"),
        ("links.inter.busbw_GBps", {"value": 11, "low": 9}, "exactly value, low and high"),
        ("links.intra.alpha_us", -7, "positive number"),
        ("host_optimizer_slowdown", {"value": 30, "low": 0, "high": 60}, "positive"),
        ("device_memory_GiB", "forty", "positive number"),
        ("links.inter.nics_per_node", 2, "busbw_GBps alone"),
        ("links.inter", {"alpha_us": 10, "nics_per_node": 1.5, "busbw_GBps_per_nic": 11}, "whole number"),
    ],
)
def test_every_cluster_number_takes_a_range_and_a_bad_one_is_refused_by_name(tmp_path, key, value, says):
    named = "links.inter.nics_per_node" if key == "links.inter" else key
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")) as err:
        read_cluster(cluster_file(tmp_path, {key: value}), None)
    assert says in str(err.value)


def test_the_interval_is_the_rate_with_every_input_at_either_end(tmp_path):
    cluster = read_cluster(str(CLUSTER), None)
    cfg = load_experiment("quickstart", SMALL)
    shape = model_shape(cfg.model.model_dump())
    m = candidate_strategies(RecommendRequest("quickstart", SMALL, strategies="ddp"), cfg, 8, 2, shape)[0]["ddp"]
    step = count_step_ops(cfg.model, cfg.training, 512)
    rec = recommendation(tmp_path, "quickstart", SMALL, str(CLUSTER), nnodes=4, global_batch=4096, strategies="ddp")
    (c,) = rec.candidates
    # by hand: every per-kernel number and link at the end that makes the step longest
    doc = yaml.safe_load(CLUSTER.read_text())
    slow_profile = device_profile(cluster, step, MEASURED, "fp32", "slow")
    by_hand = project_step(m, shape, slow_profile, pj.network_from_cluster(doc, "x", "slow"), Scenario(8, 4, 512))
    assert c.samples_per_s_low == pytest.approx(8 * 512 / by_hand.step_s)
    assert cluster.device("fp32", "slow").host_s_per_kernel == doc["host_us_per_kernel"]["high"] * 1e-6
    assert c.samples_per_s_low < c.samples_per_s < c.samples_per_s_high
    assert (c.samples_per_s_high - c.samples_per_s_low) / c.samples_per_s > 0.5  # 8 to 25 us per kernel alone
    assert (
        "host_us_per_kernel 8 to 25" in rec.target.interval and "links.inter.busbw_GBps 9 to 12" in rec.target.interval
    )
    # stated without ranges, and nothing measured here varying: no interval at all
    exact = {k: doc[k]["value"] for k in ("host_us_per_kernel", "device_tflops", "memory_bandwidth_GBps")}
    exact |= {
        f"links.{n}.{f}": v["value"] for n in doc["links"] for f, v in doc["links"][n].items() if isinstance(v, dict)
    }
    (flat,) = recommendation(
        tmp_path, "quickstart", SMALL, cluster_file(tmp_path, exact), nnodes=4, global_batch=4096, strategies="ddp"
    ).candidates
    assert flat.samples_per_s_low == pytest.approx(flat.samples_per_s) == pytest.approx(flat.samples_per_s_high)
    assert flat.samples_per_s == pytest.approx(c.samples_per_s)


def test_overlapping_picks_share_their_rank_and_the_report_says_so(tmp_path):
    rec = recommendation(
        tmp_path,
        "quickstart",
        SMALL,
        str(CLUSTER),
        nnodes=4,
        global_batch=4096,
        strategies="ddp,zero3,zero3_offload,fsdp2",
    )
    first = [c for c in rec.candidates if c.rank == 1]
    assert len(first) > 1 and all(c.tied for c in first)
    for c in first[1:]:  # each reaches into the interval of the fastest
        assert c.samples_per_s_high >= first[0].samples_per_s_low
        assert c.why.startswith(f"= equivalent within the stated uncertainty to {first[0].strategy}")
    text, doc = markdown(rec), document(rec)
    assert f"| 1= | {first[1].strategy} |" in text and "equivalent within the stated uncertainty" in text
    assert doc["equivalent_picks"] == [c.strategy for c in first]
    assert all(row["equivalent_within_uncertainty"] for row in doc["ranking"][: len(first)])
    # with exact inputs the same picks are ranked one by one
    network = pj.network_from_cluster(yaml.safe_load(CLUSTER.read_text()), "x")
    exact = Target("exact", 4, 2, 40 * 2**30, network)
    profile = {"value": pj.ComputeProfile("hand-made", samples=512, compute_s=0.004)}
    beside = StepMemory("hand-made", 1e6, 1e3)
    cfg = load_experiment("quickstart", SMALL)
    shape = model_shape(cfg.model.model_dump())
    models = candidate_strategies(
        RecommendRequest("quickstart", SMALL, strategies="ddp,zero3,zero3_offload"), cfg, 8, 2, shape
    )[0]
    order = ranked([lay_out(m, shape, profile, beside, exact, 4096) for m in models.values()])
    assert [c.rank for c in order] == [1, 2, 3] and not any(c.tied for c in order)


def test_a_model_one_device_trains_as_fast_is_told_so_with_the_numbers(tmp_path):
    # the published study's pykan [2, 64, 1]: a step of thousands of launches whatever its samples
    rec = recommendation(tmp_path, PAPER, [], str(CLUSTER), nnodes=4, global_batch=4096, strategies="ddp")
    one, pick = rec.one_device, rec.pick
    assert one is not None and pick is not None and one.fits and one.micro_batch * one.grad_accum == 4096
    assert pick.samples_per_s_low <= one.samples_per_s_high
    assert rec.verdict is not None and rec.verdict.startswith("One device is the answer")
    assert f"{one.samples_per_s:,.0f}" in rec.verdict and f"{pick.samples_per_s:,.0f}" in rec.verdict
    assert rec.verdict in markdown(rec) and document(rec)["verdict"] == rec.verdict
    assert document(rec)["one_device"]["nodes"] == 1
    # where more ranks are faster beyond the intervals, no such verdict
    faster = replace(pick, samples_per_s_low=one.samples_per_s_high * 1.01)
    assert one_device_verdict(faster, one, 8) is None
    assert one_device_verdict(pick, one, 1) is None


def test_search_limits_are_found_or_beyond_never_a_cap(tmp_path):
    cfg = load_experiment("quickstart", SMALL)
    shape = model_shape(cfg.model.model_dump())
    m = candidate_strategies(RecommendRequest("quickstart", SMALL, strategies="ddp"), cfg, 2, 2, shape)[0]["ddp"]
    network = pj.network_from_cluster(yaml.safe_load(CLUSTER.read_text()), "x")
    profile = {"value": pj.ComputeProfile("hand-made", samples=512, compute_s=0.004)}
    beside = StepMemory("hand-made", 1e6, 1e3)
    huge = Target("huge", 1, 2, 2.0**60, network)
    c = lay_out(m, shape, profile, beside, huge, 1024)
    widest, beyond = largest_widths(m, cfg, c, huge, beside)
    assert beyond and widest == [8, 64 * WIDTHS_CAP, 64 * WIDTHS_CAP, 1]
    assert limit(widest, beyond) == f"beyond {widest}"
    roomy = Target("roomy", 1, 2, 2.0**30, network)
    c = lay_out(m, shape, profile, beside, roomy, 1024)
    widest, beyond = largest_widths(m, cfg, c, roomy, beside)
    assert not beyond and 64 < widest[1] < 64 * WIDTHS_CAP and limit(widest, beyond) == str(widest)
    assert not c.micro_batch_beyond and limit(c.largest_micro_batch, False) == f"{c.largest_micro_batch:,}"
    nothing_grows = lay_out(m, shape, profile, StepMemory("hand-made", 1e6, 0.0), roomy, 1024)
    assert nothing_grows.micro_batch_beyond


def test_every_row_names_the_bound_of_its_step():
    cfg = load_experiment("quickstart", SMALL)
    shape = model_shape(cfg.model.model_dump())
    m = candidate_strategies(RecommendRequest("quickstart", SMALL, strategies="zero2"), cfg, 8, 2, shape)[0]["zero2"]
    doc = yaml.safe_load(CLUSTER.read_text())
    profile = {"value": pj.ComputeProfile("hand-made", samples=512, compute_s=0.004)}
    beside = StepMemory("hand-made", 1e6, 1e3)
    launches = Target("t", 4, 2, 2.0**34, pj.network_from_cluster(doc, "x"), compute_bounds={"launches/host": 1.0})
    c = lay_out(m, shape, profile, beside, launches, 4096)
    assert c.bound == "launches/host" and sum(c.by_bound.values()) == pytest.approx(c.projection.step_s)
    doc["links"]["inter"]["busbw_GBps"] = 0.001  # a link a thousandth of a GB/s: the step waits on it
    slow_link = replace(launches, network=pj.network_from_cluster(doc, "x"))
    c = lay_out(m, shape, profile, beside, slow_link, 4096)
    assert c.bound == "communication" and c.bound_words.startswith("communication (")


def test_several_nics_carry_the_inter_node_bytes_together(tmp_path):
    doc = yaml.safe_load(CLUSTER.read_text())
    one = pj.network_from_cluster(doc, "x")
    inter = {"alpha_us": 10.0, "nics_per_node": 4, "busbw_GBps_per_nic": 11.0}
    four = pj.network_from_cluster({**doc, "links": {**doc["links"], "inter": inter}}, "x")
    nbytes, alpha = 64 * 2**20, 2 * 15 * 10e-6  # an all-reduce over 16 ranks: 30 ring steps
    # 4 ranks a node drive the 4 NICs: the bytes' time is a quarter of one NIC's, the latency the same
    assert four.collective_s("all_reduce", nbytes, 16, 4) - alpha == pytest.approx(
        (one.collective_s("all_reduce", nbytes, 16, 4) - alpha) / 4
    )
    # one rank a node reaches one NIC; inside a node the NICs do not count
    assert four.collective_s("all_reduce", nbytes, 4, 4) == pytest.approx(one.collective_s("all_reduce", nbytes, 4, 4))
    assert four.collective_s("all_gather", nbytes, 2, 1) == one.collective_s("all_gather", nbytes, 2, 1)
    # the old single bandwidth is one NIC
    single = pj.network_from_cluster(
        {**doc, "links": {**doc["links"], "inter": {"alpha_us": 10.0, "nics_per_node": 1, "busbw_GBps_per_nic": 11.0}}},
        "x",
    )
    assert single.collective_s("all_reduce", nbytes, 16, 4) == pytest.approx(
        one.collective_s("all_reduce", nbytes, 16, 4)
    )
    for bad, says in (
        ({"alpha_us": 10.0, "nics_per_node": 2}, "busbw_GBps_per_nic"),
        ({**inter, "nics_per_node": 0}, "1 or more"),
    ):
        with pytest.raises(ConfigError, match=says):
            read_cluster(cluster_file(tmp_path, {"links.inter": bad}), None)
    assert math.isfinite(four.collective_s("all_reduce", 1.0, 16, 4))


def test_on_this_machine_the_interval_comes_from_what_is_measured_here(tmp_path):
    fits = [
        {"link": "intra", "op": op, "link_alpha_s": 50e-6, "link_beta_s_per_byte": 1e-9}
        for op in ("all_reduce", "reduce_scatter", "all_gather")
    ]
    bench = tmp_path / "commbench.json"
    bench.write_text(json.dumps({"kind": "kanscale commbench", "fits": fits, "ranks_per_node": 2, "device": "cpu"}))
    r = RecommendRequest("quickstart", SMALL, network=[str(bench)], nproc_per_node=2, strategies="ddp")
    cfg = load_experiment("quickstart", SMALL)
    shape = model_shape(cfg.model.model_dump())
    models, excluded = candidate_strategies(r, cfg, 2, 2, shape)
    memory = StepMemory("hand-made", fixed=1e6, per_sample=1e3)
    labels = ["single", "*", "ddp"]
    probe = Probe(dict.fromkeys(labels, MEASURED), dict.fromkeys(labels, memory), {}, memory, 512, tmp_path / "none")
    rec = advise(r, cfg, shape, models, excluded, probe, None)
    (c,) = rec.candidates
    assert c.samples_per_s_low < c.samples_per_s < c.samples_per_s_high  # the links' +-30%, nothing else
    assert "commbench" in rec.target.interval and any(a == rec.target.interval for a in rec.assumptions)
    ends = measured_ends(MEASURED, 0.1)
    assert ends["slow"].compute_s == pytest.approx(1.1 * MEASURED.compute_s)
    assert ends["fast"].data_s == pytest.approx(0.9 * MEASURED.data_s)
