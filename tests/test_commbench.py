"""kanscale commbench: nccl-tests' bandwidth definitions, the zoo's message sizes, and a real
two-rank run on gloo across two launcher agents (an inter-node link on 127.0.0.1)."""

import json
import math
import subprocess
import sys
import time

import pytest

from analysis.projection import HOST_COPY, OPS, MiB, busbw_factor
from launchers.cli import main
from launchers.commbench import BenchOptions, iterations, message_sizes, rank_command
from launchers.launch.commands import LaunchSpec
from launchers.shared_cores import COMPUTE_S as SHARED_CORES_COMPUTE_S
from launchers.shared_cores import units_in
from tests.helpers.launch import ROOT, child_env, two_agent_commbench


def test_bus_bandwidth_factors_are_nccl_tests():
    # doc/PERFORMANCE.md of nccl-tests: all-reduce 2(n-1)/n, reduce-scatter and all-gather (n-1)/n
    assert busbw_factor("all_reduce", 2) == 1.0 and busbw_factor("all_reduce", 8) == 1.75
    assert busbw_factor("reduce_scatter", 4) == 0.75 and busbw_factor("all_gather", 8) == 0.875
    assert busbw_factor(HOST_COPY, 8) == 1.0
    with pytest.raises(ValueError, match="unknown operation 'broadcast'"):
        busbw_factor("broadcast", 2)


def test_sweep_holds_the_zoo_sizes_and_divides_into_shards():
    messages = message_sizes(world_size=4, min_bytes=4, max_bytes=200 * MiB)
    by_label = {label: m.nbytes for m in messages for label in m.labels}
    assert by_label["study pykan gradients"] == 4 * 3648  # pykan [2, 64, 1]: 3,648 trainable parameters
    assert by_label["study bspline gradients"] == 4 * 2880
    assert by_label["study pykan gradient shard (1/4)"] == 3648
    assert by_label["DDP bucket (25 MiB)"] == 25 * MiB
    assert 4 * 19e6 < by_label["20M bspline gradients"] < 4 * 21e6
    sizes = [m.nbytes for m in messages]
    assert sizes == sorted(set(sizes)) and all(s % 16 == 0 for s in sizes)  # float32, 4 equal shards
    assert {4**k * 4 for k in range(1, 12)} <= set(sizes)  # the powers of four are there too
    assert [m.nbytes for m in message_sizes(2, 64, 4096)] == [64, 256, 1024, 4096]  # zoo sizes out of range left out


def test_large_messages_get_fewer_iterations():
    options = BenchOptions(iters=20, warmup=5)
    assert iterations(1024, options) == (5, 20)
    assert iterations(64 * MiB, options) == (1, 3)


def test_every_rank_runs_the_commbench_module_with_the_options_as_json():
    options = BenchOptions(out="x/cb.json", max_bytes=65536, iters=3, warmup=1, device="cpu")
    assert BenchOptions.from_json(options.to_json()) == options
    cmd = rank_command(LaunchSpec(nproc_per_node=2), options)
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and "--nproc_per_node=2" in cmd
    assert cmd[-3:] == ["-m", "launchers.commbench", options.to_json()]
    assert "launchers.cli" not in cmd and "--worker" not in cmd
    assert rank_command(LaunchSpec(nproc_per_node=2), options, debug=True)[-1] == "--debug"


def test_a_worker_without_peers_fails_in_one_line_and_exits(tmp_path):
    """Started by hand (no torchrun) the worker joins a one-rank group, refuses it, and leaves
    through exit_without_teardown with kanscale's one-line error and exit code 1."""
    options = BenchOptions(out=str(tmp_path / "cb.json"), device="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "launchers.commbench", options.to_json()],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=child_env(),
    )
    assert proc.returncode == 1, proc.stderr
    assert "kanscale: commbench failed: RuntimeError: commbench needs at least 2 ranks" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "cb.json").exists()


@pytest.mark.slow  # the slow tier (make test-slow)
def test_commbench_over_two_agents_on_gloo(tmp_path_factory):
    out = two_agent_commbench(tmp_path_factory)
    doc = json.loads(out.read_text())
    assert (doc["kind"], doc["backend"], doc["device"]) == ("kanscale commbench", "gloo", "cpu")
    assert (doc["world_size"], doc["nodes"], doc["ranks_per_node"], doc["link"]) == (2, 2, 1, "inter")
    sizes = sorted({r["bytes"] for r in doc["results"]})
    assert sizes[0] == 8 and sizes[-1] == 16384  # 4 bytes rounds up to one float32 per rank
    assert len(doc["results"]) == len(sizes) * 4
    for r in doc["results"]:
        assert 0 < r["time_min_s"] <= r["time_s"] <= r["time_max_s"] < 5
        assert math.isclose(r["algbw_GBps"], r["bytes"] / r["time_s"] / 1e9)
        assert math.isclose(r["busbw_GBps"], r["algbw_GBps"] * busbw_factor(r["op"], 2))
    assert any("study pykan gradients" in r["labels"] for r in doc["results"])
    fits = {f["op"]: f for f in doc["fits"]}
    assert set(fits) == set(OPS) | {HOST_COPY} and fits[HOST_COPY]["link"] == "host"
    for f in fits.values():
        assert all(math.isfinite(f[k]) and f[k] >= 0 for k in ("alpha_s", "beta_s_per_byte", "link_alpha_s"))
        assert f["alpha_s"] + f["beta_s_per_byte"] > 0
    assert fits["all_reduce"]["link"] == "inter"
    assert math.isclose(fits["all_reduce"]["link_alpha_s"], fits["all_reduce"]["alpha_s"] / 2)  # 2 ring steps at P = 2
    assert "busbw GB/s" in out.with_suffix(".md").read_text()
    # the same work on both ranks at once, each step ended by an all-reduce, against one rank alone
    shared = doc["shared_cores"]
    lengths = [r["compute_s"] for r in shared]
    assert len(lengths) == len(SHARED_CORES_COMPUTE_S) and lengths == sorted(lengths), lengths
    for r in shared:
        assert 0 < r["factor_low"] <= r["factor"] <= r["factor_high"]
        assert r["factor"] == pytest.approx(r["together_s"] / r["compute_s"])
    assert "Ranks sharing this machine's cores" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nproc-per-node", "1"], "needs at least 2 ranks"),
        (["--out", "bench.md"], "--out: give a .json file"),
        (["--min-bytes", "64", "--max-bytes", "512"], "--max-bytes: must be at least 16 x --min-bytes (1024)"),
        (["--nproc-per-node", "64"], "lower --nproc-per-node"),
        (["--worker"], "unrecognized arguments: --worker"),  # every rank runs python -m launchers.commbench instead
    ],
)
def test_commbench_refuses_bad_flags(argv, message, capsys, in_tmp_cwd):
    try:
        code = main(["commbench", *argv])
    except SystemExit as exit:  # argparse's own refusals
        code = exit.code
    assert code == 2
    assert message in capsys.readouterr().err
    assert not list(in_tmp_cwd.iterdir())  # refused before anything is written


def test_one_stall_while_calibrating_does_not_shorten_the_work_timed():
    """A unit of 0.5 ms whose third call is held 30 ms, longer than the whole calibration window
    (another process given the core): 16 ms is still about 32 units."""
    calls = []

    def unit() -> None:
        calls.append(None)
        if len(calls) == 3:
            time.sleep(0.03)
        end = time.perf_counter() + 5e-4
        while time.perf_counter() < end:
            pass

    assert 26 <= units_in(16e-3, unit) <= 32
