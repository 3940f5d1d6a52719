"""The step time on a GPU per operation: the kernels of one training step counted here
(launchers/recommend/step_ops.py), each costed at its roofline with the host's floor
(analysis/projection/device_time.py), the cluster file's per-kernel fields checked, and the
published study's rates on a100_ib.yaml predicted within 2x, its bound named."""

import json
import subprocess
import sys

import pytest
import yaml

from analysis.projection.device_time import Device, Op, device_time
from kan_models import parse_model_config
from kanscale.errors import ConfigError
from launchers.recommend.step_ops import _count, count_step_ops
from launchers.recommend.target import read_cluster
from strategies.experiment import load_experiment
from tests.helpers.launch import ROOT, child_env

PAPER = ROOT / "configs/experiments/paper_kan64.yaml"
CLUSTER = ROOT / "configs/clusters/a100_ib.yaml"


def test_pykans_step_is_far_more_kernels_than_the_fast_bspline_layers_and_counts_repeat():
    cfg = load_experiment(str(PAPER), [])
    pykan = count_step_ops(cfg.model, cfg.training, 512)
    again = count_step_ops(cfg.model, cfg.training, 512)
    fast_model = parse_model_config({"family": "bspline", "widths": [2, 64, 1], "grid": 10, "k": 3})
    fast = count_step_ops(fast_model, cfg.training, 512)
    assert [(o.name, o.phase, o.flops, o.bytes) for o in pykan.ops] == [
        (o.name, o.phase, o.flops, o.bytes) for o in again.ops
    ]
    assert pykan.kernels > 20 * fast.kernels  # pykan loops over edges in Python
    assert {o.phase for o in fast.ops} == {"forward", "backward", "optimizer"}
    assert fast.flops > 0 and fast.bytes > 0
    assert not any(o.name in ("aten.view", "aten.t", "aten.detach", "aten.expand") for o in fast.ops)


def test_fake_tensors_count_what_real_ones_do():
    cfg = load_experiment(str(PAPER), [])
    model = parse_model_config({"family": "chebyshev", "widths": [8, 64, 1], "degree": 4})
    fake, real = count_step_ops(model, cfg.training, 256), _count(model, cfg.training, 256, seed=0)
    assert fake.ops == real.ops and fake.kernels > 0
    large = parse_model_config({"family": "bspline", "widths": [64, 4096, 4096, 1], "grid": 10})
    assert count_step_ops(large, cfg.training, 512).flops > 1e11  # ~220M parameters, no storage


def test_each_bound_wins_where_it_should():
    device = Device(host_s_per_kernel=10e-6, flops_per_s=1e13, bytes_per_s=1e12)
    tiny = Op("tiny", "forward", flops=1e3, bytes=1e3)  # host floor
    matmul = Op("mm", "backward", flops=1e12, bytes=1e6)  # 0.1 s of FLOPs
    copy = Op("copy", "optimizer", flops=0.0, bytes=1e10)  # 10 ms of bytes
    assert device.op_s(tiny) == (10e-6, "launches/host")
    assert device.op_s(matmul) == (pytest.approx(0.1), "compute")
    assert device.op_s(copy) == (pytest.approx(0.01), "memory bandwidth")
    t = device_time([tiny] * 2000 + [copy], device)
    assert t.kernels == 2001 and t.step_s == pytest.approx(2000 * 10e-6 + 0.01)
    assert t.bound == "launches/host" and t.phase_s("optimizer") == pytest.approx(0.01)
    assert device_time([tiny, matmul], device).bound == "compute"


@pytest.mark.parametrize(
    "value, named",
    [({"value": 15, "low": 20, "high": 25}, "low <= value"), ("fast", "positive number"), ({"value": 15}, "high")],
)
def test_a_bad_per_kernel_cost_is_refused_with_its_field_and_fix(tmp_path, value, named):
    doc = yaml.safe_load(CLUSTER.read_text())
    doc["host_us_per_kernel"] = value
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match="host_us_per_kernel") as err:
        read_cluster(str(path), None)
    assert named in str(err.value)
    del doc["host_us_per_kernel"], doc["memory_bandwidth_GBps"]
    doc["host_us_per_kernel"] = 15
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match="memory_bandwidth_GBps"):
        read_cluster(str(path), None)


@pytest.mark.slow  # a 1-rank probe each
@pytest.mark.parametrize("nnodes, per_node, batch, published", [(1, 1, 512, 4442), (4, 2, 4096, 26618)])
def test_the_published_studys_rates_are_predicted_within_2x_launch_bound(tmp_path, nnodes, per_node, batch, published):
    out = tmp_path / "rec.json"
    command = [sys.executable, "-m", "launchers.cli", "recommend", str(PAPER), "--cluster", str(CLUSTER)]
    command += ["--nnodes", str(nnodes), "--nproc-per-node", str(per_node), "--global-batch", str(batch)]
    command += ["--strategies", "ddp", "--out", str(tmp_path / "rec"), "--json", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=child_env(), timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    pick = json.loads(out.read_text())["ranking"][0]
    assert published / 2 <= pick["samples_per_s"]["predicted"] <= published * 2
    assert "bound of the compute: launches/host" in proc.stdout
