"""Hybrid sharding before anything starts: the presets' meshes at a launch's nodes and ranks, the
refusals that name the option and its fix (followed here), and the projection's intra- and
inter-node groups. The 4-rank runs are tests/test_hybrid_sharding.py."""

import re
from pathlib import Path

import pytest
import yaml

from analysis import projection as pj
from analysis.projection.memory import StepMemory
from kan_models import parse_model_config
from kanscale.errors import ConfigError
from launchers.cli import main
from launchers.recommend.advise import probe_names, stand_in
from launchers.recommend.probe import Probe
from launchers.zoo import model_shape
from strategies.experiment import load_experiment, load_strategy
from strategies.runtime.mesh import MeshShape
from strategies.sections import TrainingConfig
from tests.helpers.launch import ROOT

MODEL = parse_model_config({"family": "bspline", "widths": [2, 8, 1]})
CLUSTER = pj.network_from_cluster(yaml.safe_load((ROOT / "configs/clusters/a100_ib.yaml").read_text()), "a100_ib.yaml")


@pytest.mark.parametrize(
    "preset, label", [("hsdp", "hsdp"), ("fsdp1_hybrid", "fsdp1_hybrid"), ("fsdp1_hybrid_zero2", "fsdp1_hybrid_zero2")]
)
def test_the_hybrid_presets_shard_inside_a_node_and_replicate_across(preset, label):
    strategy = load_strategy(preset, MODEL)
    assert strategy.label() == label
    assert strategy.mesh_shape(8, ranks_per_node=4) == MeshShape(dp_replicate=2, dp_shard=4)
    assert strategy.mesh_shape(4, ranks_per_node=4) == MeshShape(dp_shard=4)  # one node: full sharding


def test_a_shard_degree_is_checked_against_the_launch():
    strategy = load_strategy("hsdp", MODEL).model_copy(update={"shard_degree": 3})
    with pytest.raises(
        ConfigError,
        match=r"strategy.shard_degree: 3 ranks per shard group does not divide the world "
        r"size 4 .* give a divisor of 4",
    ):
        strategy.mesh_shape(4, ranks_per_node=2)
    across = load_strategy("hsdp", MODEL).model_copy(update={"shard_degree": 2})
    with pytest.raises(ConfigError, match="would cut a group across a node boundary"):
        across.mesh_shape(6, ranks_per_node=3)
    # the fixes the messages give
    assert strategy.model_copy(update={"shard_degree": 2}).mesh_shape(4, 2) == MeshShape(dp_replicate=2, dp_shard=2)
    assert across.model_copy(update={"shard_degree": "node"}).mesh_shape(6, 3) == MeshShape(dp_replicate=2, dp_shard=3)


def test_fsdp1_takes_a_shard_degree_only_with_a_hybrid_strategy():
    strategy = load_strategy("fsdp1", MODEL).model_copy(update={"shard_degree": 2})
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "strategy.shard_degree: 2 sets the shard group of the hybrid sharding "
            "strategies, and sharding_strategy is FULL_SHARD; set "
            "strategy.sharding_strategy=HYBRID_SHARD"
        ),
    ):
        strategy.preflight(TrainingConfig(), "cpu", 4)
    strategy.model_copy(update={"sharding_strategy": "HYBRID_SHARD"}).preflight(TrainingConfig(), "cpu", 4)


def test_zero_plus_plus_is_checked_before_launch():
    hpz = load_strategy("zero3_hpz", MODEL)
    assert hpz.label() == "zero3_hpz" and hpz.hpz_partition_size == 2  # from the native file
    assert hpz.resolve(TrainingConfig(), 4)["zero_optimization"]["zero_hpz_partition_size"] == 2
    assert hpz.cost_model() is None  # not projected yet: kanscale project and recommend say so
    with pytest.raises(
        ConfigError,
        match=r"strategy.hpz_partition_size: 2 ranks .* must divide the ranks of one node "
        r"\(3\)",
    ):
        hpz.mesh_shape(6, ranks_per_node=3)
    staged = hpz.model_copy(update={"zero_stage": 2})
    with pytest.raises(ConfigError, match=r"strategy\.zero_stage: ZeRO\+\+ .* is part of stage 3"):
        staged.preflight(TrainingConfig(), "cpu", 4)
    quantized = hpz.model_copy(update={"quantized_weights": True, "quantized_gradients": True})
    assert quantized.label() == "zero3_hpz_quantized"
    with pytest.raises(
        ConfigError,
        match=r"strategy\.quantized_weights: ZeRO\+\+'s quantized collectives run "
        r"DeepSpeed's CUDA quantizer kernels.*set strategy\.quantized_weights=false "
        r"and strategy\.quantized_gradients=false",
    ):
        quantized.preflight(TrainingConfig(), "cpu", 4)
    quantized.model_copy(update={"quantized_weights": False, "quantized_gradients": False}).preflight(
        TrainingConfig(), "cpu", 4
    )


def test_kanscale_run_refuses_a_shard_group_the_launch_cannot_hold(tmp_path, capsys):
    """Before any process starts, with the launch's own nodes and ranks per node."""
    run = ["run", "quickstart", "--strategy", "hsdp", "--nproc-per-node", "2", "--out", str(tmp_path), "--dry-run"]
    assert main([*run, "--set", "strategy.shard_degree=3"]) == 2
    assert "strategy.shard_degree: 3 ranks per shard group" in capsys.readouterr().err
    assert main([*run, "--set", "strategy.shard_degree=2"]) == 0, capsys.readouterr().err


def test_the_projection_costs_the_shard_group_on_its_node_and_the_replicas_across_nodes():
    """On the A100 cluster file (2 GPUs a node, shared memory inside it no faster than the
    InfiniBand between): hsdp holds the state of a node's 2 ranks, not of all; it adds one
    all-reduce per layer; with its shard group on the node's links and the all-reduce over one rank
    per node, it loses to full sharding over 4 nodes for a model whose layers are tens of MB
    (bandwidth-bound: it moves more bytes in all), and wins over 64 nodes, where full sharding's
    every collective pays 127 inter-node latencies."""
    shape = model_shape({"family": "bspline", "widths": [64, 1024, 1024, 1], "grid": 10})
    hsdp, fsdp2 = (load_strategy(name, MODEL).cost_model() for name in ("hsdp", "fsdp2"))
    profile = pj.ComputeProfile("13 TFLOP/s", samples=512, compute_s=6 * shape.trainable * 512 / 13e12)
    rows = {
        (r.strategy, r.ranks): r
        for r in pj.project([hsdp, fsdp2], shape, {"*": profile}, CLUSTER, [8, 128], 2, global_batch=8192)
    }
    assert rows["hsdp", 8].state["params"] == pytest.approx(4 * rows["fsdp2", 8].state["params"])
    assert rows["hsdp", 128].state == pj.model_state(hsdp, shape, 128, ranks_per_node=2) == rows["hsdp", 8].state
    units = len(shape.units)
    # fsdp2: per unit 3 collectives (gather, gather again, reduce-scatter); hsdp adds the replicas' all-reduce
    assert rows["fsdp2", 8].collectives == 3 * units and rows["hsdp", 8].collectives == 4 * units
    assert rows["hsdp", 8].samples_per_s < rows["fsdp2", 8].samples_per_s
    assert rows["hsdp", 128].samples_per_s > 1.2 * rows["fsdp2", 128].samples_per_s


def test_a_hybrid_strategy_is_predicted_from_its_own_backends_probe(tmp_path):
    """At one rank hsdp runs fsdp2's code and fsdp1_hybrid fsdp1's: kanscale recommend probes
    neither, and takes the sibling of the same backend (fsdp1 and fsdp2 describe the same
    collectives, but their bookkeeping per step differs 2.5x here)."""
    cfg = load_experiment("quickstart", [])
    models = {name: load_strategy(name, cfg.model).cost_model() for name in ("fsdp1", "fsdp1_hybrid", "fsdp2", "hsdp")}
    assert probe_names(models, cfg) == ["single", "fsdp1", "fsdp2"]
    probed = ("single", "fsdp1", "fsdp2", "*")
    nothing = StepMemory("none", 0.0, 0.0)
    probe = Probe(
        compute={label: pj.ComputeProfile(label, 1, 1.0) for label in probed},
        beside=dict.fromkeys(probed, nothing),
        optimizer_bytes={},
        device=nothing,
        micro_batch=1,
        runs=Path(tmp_path),
    )
    assert {name: stand_in(m, probe, models) for name, m in models.items()} == {
        "fsdp1": "fsdp1",
        "fsdp1_hybrid": "fsdp1",
        "fsdp2": "fsdp2",
        "hsdp": "fsdp2",
    }
