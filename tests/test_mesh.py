"""The run's device mesh (strategies/runtime/mesh.py): the suite's own arithmetic (which data share a
rank trains on, which ranks hold one replica) agrees with where torch's DeviceMesh puts the rank,
so data sharding and the backends' collectives see the same layout; each strategy declares the
mesh it runs on."""

import json
import sys

import pytest

from kan_models import parse_model_config
from kanscale.errors import ConfigError
from strategies.backends.fsdp1 import FSDP1Config
from strategies.experiment import load_strategy
from strategies.runtime.distributed import DistEnv
from strategies.runtime.mesh import DIMS, MeshShape, RunMesh
from tests.helpers.launch import ROOT, run

MODEL = parse_model_config({"family": "bspline", "widths": [2, 8, 1]})
SHAPES = {  # every way 4 ranks split over the three dimensions that the suite's strategies use or will
    "shard": {"dp_shard": 4},
    "replicate": {"dp_replicate": 4},
    "tp": {"tp": 4},
    "hybrid": {"dp_replicate": 2, "dp_shard": 2},
    "shard_tp": {"dp_shard": 2, "tp": 2},
    "replicate_tp": {"dp_replicate": 2, "tp": 2},
}


@pytest.fixture(scope="module")
def placed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mesh")
    (tmp / "shapes.json").write_text(json.dumps(SHAPES))
    run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=4",
            str(ROOT / "tests/helpers/mesh_worker.py"),
            str(tmp / "shapes.json"),
            str(tmp / "out.json"),
        ]
    )
    return json.loads((tmp / "out.json").read_text())


@pytest.mark.parametrize("name", SHAPES)
def test_the_suite_places_each_rank_where_torch_does(placed, name):
    for rank, seen in enumerate(placed[name]):
        assert seen["coords"] == seen["torch_coords"], f"rank {rank}"
        assert seen["torch_dp"] == [seen["dp_rank"], seen["dp_size"]], f"rank {rank}: the flattened dp sub-mesh"


@pytest.mark.parametrize("name", SHAPES)
def test_every_data_share_is_trained_by_one_replica(placed, name):
    ranks = placed[name]
    shares = {(r["dp_rank"], r["tp_rank"]) for r in ranks}
    assert len(shares) == len(ranks)  # no two ranks of one TP position train on the same share
    for seen in ranks:
        tp_group = seen["groups"]["tp"]
        assert tp_group == list(range(tp_group[0], tp_group[0] + len(tp_group)))  # a replica's ranks are consecutive
        assert {ranks[r]["dp_rank"] for r in tp_group} == {seen["dp_rank"]}  # and see the same samples


def test_ranks_lie_row_major_with_tp_fastest():
    shape = MeshShape(dp_replicate=2, dp_shard=2, tp=2)
    places = [RunMesh(shape, rank, "cpu") for rank in range(8)]
    assert [m.tp_rank for m in places] == [0, 1] * 4
    assert [m.dp_rank for m in places] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert {m.ranks_per_replica for m in places} == {2}
    with pytest.raises(ValueError, match="not on a mesh of 8 ranks"):
        RunMesh(shape, 8, "cpu")


@pytest.mark.parametrize(
    "preset, sizes",
    [
        ("single", {"dp_replicate": 4}),
        ("ddp", {"dp_replicate": 4}),
        ("zero0", {"dp_replicate": 4}),
        ("zero2", {"dp_shard": 4}),
        ("zero3_offload", {"dp_shard": 4}),
        ("fsdp1", {"dp_shard": 4}),
        ("fsdp1_grad_op", {"dp_shard": 4}),
        ("fsdp2", {"dp_shard": 4}),
        ("tp", {"tp": 4}),
        ("fsdp2_tp", {"dp_shard": 2, "tp": 2}),
    ],
)
def test_each_strategy_declares_its_mesh(preset, sizes):
    shape = load_strategy(preset, MODEL, "strategy").mesh_shape(4)
    assert shape == MeshShape(**sizes) and shape.world_size == 4


def test_fsdp1_without_sharding_keeps_whole_replicas():
    assert FSDP1Config(name="fsdp1", sharding_strategy="NO_SHARD").mesh_shape(4) == MeshShape(dp_replicate=4)


def test_a_tp_degree_that_does_not_divide_the_world_is_refused_by_name():
    fsdp2_tp = load_strategy("fsdp2_tp", MODEL, "strategy")
    with pytest.raises(ConfigError, match=r"strategy.tp_degree: 2 does not divide the world size 3"):
        fsdp2_tp.mesh_shape(3)


def test_an_environment_starts_as_whole_replicas_and_moves_onto_the_run_mesh():
    env = DistEnv(rank=3, world_size=4)
    assert (env.mesh.dp_rank, env.mesh.dp_size, env.mesh.ranks_per_replica) == (3, 4, 1)
    placed = env.on_mesh(MeshShape(dp_shard=2, tp=2))
    assert (placed.mesh.dp_rank, placed.mesh.tp_rank, placed.mesh.ranks_per_replica) == (1, 1, 2)
    assert env.mesh.dp_size == 4 and set(placed.mesh.coords) == set(DIMS)  # the original is left as it was
