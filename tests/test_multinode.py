"""Two "nodes" on one machine, started the way users start real ones: one `kanscale run` per
node. Each trains for real and the pair writes one run record with nodes = 2."""

import subprocess
import sys

import pytest

from analysis.records.run_files import read_summary
from tests.helpers.launch import ROOT, child_env, free_port

# The slow tier (make test-slow, run by .ci/run): two-node launches started as users start them.
pytestmark = pytest.mark.slow

RUN = [
    sys.executable,
    "-m",
    "launchers.cli",
    "run",
    str(ROOT / "configs/experiments/quickstart.yaml"),
    "--set",
    "training.steps=10",
    "--set",
    "measurement.baseline_steps=2",
    "--set",
    "training.micro_batch=64",
]


def two_nodes(args_for_node, timeout=240):
    procs = [
        subprocess.Popen(
            args_for_node(rank), cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for rank in (0, 1)
    ]
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-6000:]
    return outputs


def the_record(out):
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    return read_summary(run_dir)


def test_two_torchrun_agents_with_c10d_rendezvous(tmp_path):
    port = free_port()
    two_nodes(
        lambda rank: [
            *RUN,
            "--strategy",
            "ddp",
            "--nnodes",
            "2",
            "--node-rank",
            str(rank),
            "--master-port",
            str(port),
            "--master-addr",
            "127.0.0.1",
            "--rdzv-id",
            "test-two-nodes",
            "--out",
            str(tmp_path),
        ]
    )
    record = the_record(tmp_path)
    assert (record.status, record.topology.nodes, record.topology.world_size) == ("ok", 2, 2)
    assert (record.topology.procs_per_node, record.topology.launcher) == (1, "torchrun")


def test_deepspeed_launcher_with_two_node_ranks_and_no_ssh(tmp_path):
    port = free_port()
    two_nodes(
        lambda rank: [
            *RUN,
            "--strategy",
            "zero2",
            "--launcher",
            "deepspeed",
            "--hosts",
            "localhost,127.0.0.1",
            "--no-ssh",
            "--node-rank",
            str(rank),
            "--master-port",
            str(port),
            "--out",
            str(tmp_path),
        ]
    )
    record = the_record(tmp_path)
    assert (record.status, record.topology.nodes, record.topology.world_size) == ("ok", 2, 2)
    assert record.topology.launcher == "deepspeed" and record.strategy.distributed_type == "DEEPSPEED_ZERO2"
