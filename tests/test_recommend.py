"""kanscale recommend: the memory each strategy needs per rank, the layout and micro-batch that
fit, the ranking and its command, refusals before anything is measured; in the slow tier (each
probe a launch of its own) whole recommendations from their probes, and the picks trained here
against their prediction."""

import json
import math
import subprocess
import sys

import pytest
import yaml

from analysis import projection as pj
from analysis.projection.advice import Target, lay_out, ranked
from analysis.projection.memory import StepMemory, gathered_bytes, largest_micro_batch, peak_memory
from analysis.records.run_files import read_summary
from launchers.zoo import model_shape
from tests.helpers.launch import ROOT, child_env

MODEL = {"family": "bspline", "widths": [8, 64, 64, 1], "grid": 5}
CLUSTER = ROOT / "configs/clusters/a100_ib.yaml"


def strategy(preset: str) -> pj.StrategyModel:
    from kan_models import parse_model_config
    from strategies.experiment import load_strategy

    return load_strategy(preset, parse_model_config(MODEL)).cost_model()


def network() -> pj.Network:
    return pj.network_from_cluster(yaml.safe_load(CLUSTER.read_text()), str(CLUSTER))


def test_what_a_backend_holds_whole_beyond_its_share():
    shape = model_shape(MODEL)
    b, p = shape.dtype_bytes, shape.trainable * shape.dtype_bytes
    assert gathered_bytes(strategy("ddp"), shape, 4) == 0  # whole already: nothing more
    assert gathered_bytes(strategy("zero2"), shape, 4) == pytest.approx(p * 3 / 4)  # the whole gradient it all-reduces
    assert gathered_bytes(strategy("zero3"), shape, 4) == pytest.approx((shape.params * b + p) * 3 / 4)
    units = sorted((u * b for u in shape.units), reverse=True)
    assert gathered_bytes(strategy("fsdp2"), shape, 4) == pytest.approx((units[0] + units[1] + units[0]) * 3 / 4)
    assert all(gathered_bytes(strategy(s), shape, 1) == 0 for s in ("zero3", "fsdp2", "zero2"))


def test_the_largest_micro_batch_is_the_last_that_fits():
    shape, m = model_shape(MODEL), strategy("zero3")
    beside = StepMemory("test", fixed=3e6, per_sample=1234.5)
    capacity = 50e6
    n = largest_micro_batch(m, shape, 2, beside, capacity, offload_on_device=True)
    assert (
        peak_memory(m, shape, 2, n, beside, True).total
        <= capacity
        < peak_memory(m, shape, 2, n + 1, beside, True).total
    )
    assert largest_micro_batch(m, shape, 2, beside, peak_memory(m, shape, 2, 0, beside, True).total - 1, True) == 0


def test_offloaded_state_counts_on_a_cpu_rank_and_not_on_a_gpu():
    shape, m = model_shape(MODEL), strategy("zero3_offload")
    beside = StepMemory("test", 0.0, 0.0)
    state = pj.model_state(m, shape, 2)
    on_cpu, on_gpu = (peak_memory(m, shape, 2, 0, beside, here) for here in (True, False))
    assert on_cpu.model_state == pytest.approx(sum(state.values()))
    assert on_gpu.model_state == pytest.approx(state["params"] + state["grads"])
    assert on_gpu.host == pytest.approx(state["optimizer"] + state["master_params"])


def target(memory: float) -> Target:
    return Target(name="test", nodes=1, ranks_per_node=2, memory_per_rank=memory, network=network())


def test_a_global_batch_that_does_not_fit_is_accumulated_and_a_model_that_fits_nowhere_is_last():
    shape = model_shape(MODEL)
    profile = pj.ComputeProfile("test", samples=256, compute_s=0.01)
    beside = StepMemory("test", fixed=1e6, per_sample=10_000)
    ddp, zero3 = strategy("ddp"), strategy("zero3")
    roomy = lay_out(ddp, shape, {"value": profile}, beside, target(1e9), 1024)
    assert roomy.fits and (roomy.micro_batch, roomy.grad_accum) == (512, 1)
    # room for 256 samples beside ddp's whole state: four micro-batches of 128 per step
    tight_memory = peak_memory(ddp, shape, 2, 200, beside, True).total
    tight = lay_out(ddp, shape, {"value": profile}, beside, target(tight_memory), 1024)
    assert (
        tight.fits and (tight.micro_batch, tight.grad_accum) == (128, 4) and "4 micro-batches" in ranked([tight])[0].why
    )
    # zero3 holds less, so it fits (in small micro-batches) where ddp does not before its first sample
    nothing_fits_ddp = peak_memory(ddp, shape, 2, 0, beside, True).total - 1
    order = ranked(
        [lay_out(m, shape, {"value": profile}, beside, target(nothing_fits_ddp), 1024) for m in (ddp, zero3)]
    )
    assert [(c.strategy, c.fits) for c in order] == [("zero3", True), ("ddp", False)]
    assert order[1].why.startswith("does not fit")


def kanscale(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "launchers.cli", "recommend", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=child_env(DS_ACCELERATOR="cpu"),
    )


@pytest.mark.parametrize(
    "args, says",
    [
        (["--cluster", "NOMEM"], "device_memory_GiB: missing; give the memory of one device (GPU)"),
        (["--cluster", str(CLUSTER), "--validate", "1"], "--validate trains the picks on this machine"),
        (["--json", "out.txt"], "--json: give a .json file"),
        (["--strategies", "ddp,zer02"], "zer02"),
        (["--memory-per-device", "lots"], "is not a byte count"),
    ],
)
def test_bad_input_is_refused_before_anything_is_measured(tmp_path, args, says):
    if "NOMEM" in args:
        doc = yaml.safe_load(CLUSTER.read_text())
        del doc["device_memory_GiB"]
        (tmp_path / "nomem.yaml").write_text(yaml.safe_dump(doc))
        args = ["--cluster", str(tmp_path / "nomem.yaml")]
    proc = kanscale("quickstart", *args, "--out", str(tmp_path / "rec"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert says in proc.stderr
    assert not (tmp_path / "rec" / "probe").exists()  # nothing trained


@pytest.mark.slow  # four probe runs, each a launch of its own
def test_a_cluster_recommendation_ranks_fits_and_names_its_command(tmp_path):
    """The probes train here (three presets, one rank each), the cluster file gives links, memory
    and rate; the JSON holds the pick, the ranking, exact model state and the command."""
    out = tmp_path / "rec"
    proc = kanscale(
        "quickstart",
        "--set",
        "model.widths=[8,64,64,1]",
        "--set",
        "task.name=high_dim",
        "--set",
        "task.dim=8",
        "--set",
        "model.grid_range=[-1,1]",
        "--cluster",
        str(CLUSTER),
        "--nnodes",
        "2",
        "--strategies",
        "ddp,zero2,fsdp2",
        "--global-batch",
        "1024",
        "--json",
        str(out / "rec.json"),
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "rec.json").read_text())
    assert doc["predicted"] and doc["target"] == {
        "name": "a100_ib",
        "nodes": 2,
        "ranks_per_node": 2,
        "memory_per_rank": 40 * 2**30,
    }
    assert [c["strategy"] for c in doc["ranking"]] == sorted(
        (c["strategy"] for c in doc["ranking"]),
        key=lambda s: -next(c["samples_per_s"]["predicted"] for c in doc["ranking"] if c["strategy"] == s),
    )
    shape = model_shape({**MODEL, "grid_range": [-1, 1]})
    for c in doc["ranking"]:
        state = pj.model_state(strategy(c["strategy"]), shape, 4)
        # plus the optimizer's 4-byte step counters, measured on the probe: one per tensor torch's Adam
        # updates (ddp, fsdp2), one per flat partition DeepSpeed's does (zero2)
        counters = {"zero2": 4}.get(c["strategy"], 4 * len(shape.tensors))
        assert c["model_state_bytes"] == sum(state.values()) + counters
        assert c["fits"] and c["micro_batch"] * c["grad_accum"] * 4 == 1024
        low, mid, high = (c["samples_per_s"][k] for k in ("low", "predicted", "high"))
        assert low <= mid <= high and math.isfinite(high)
    pick = doc["pick"]
    wider = pick["largest_widths_estimated"]  # 40 GiB holds a far wider model at this depth
    assert wider[0] == 8 and wider[-1] == 1 and len(wider) == 4 and wider[1] > 64 * 10
    command = doc["command"]
    assert command[:2] == ["kanscale", "run"] and command[command.index("--strategy") + 1] == pick["strategy"]
    assert "--nnodes" in command and "Rates and memory are **predicted**" in proc.stdout
    planned = subprocess.run(
        [sys.executable, "-m", "launchers.cli", *command[1:], "--dry-run"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=child_env(),
        timeout=120,
    )
    assert planned.returncode == 0, planned.stderr[-2000:]  # the command the pick prints is one kanscale runs
    assert f"training.grad_accum={pick['grad_accum']}" in " ".join(command)
    assert "device_tflops in" in proc.stdout  # the compute assumption is printed


@pytest.mark.slow  # probes, commbench and two 2-rank runs
def test_validate_trains_the_picks_and_sets_the_prediction_beside_the_measurement(tmp_path):
    out = tmp_path / "rec"
    proc = kanscale(
        "quickstart",
        "--nproc-per-node",
        "2",
        "--strategies",
        "ddp,zero2",
        "--validate",
        "1",
        "--json",
        str(out / "rec.json"),
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "commbench.json").exists()  # this machine's links, measured for it
    rows = json.loads((out / "rec.json").read_text())["validation"]
    assert sorted(r["strategy"] for r in rows) == ["ddp", "zero2"] and all(r["status"] == "ok" for r in rows)
    for r in rows:
        assert r["predicted_model_state_bytes"] == pytest.approx(r["measured_model_state_bytes"], rel=1e-3)
        assert 0.75 < r["predicted_peak_bytes"] / r["measured_peak_bytes"] < 1.25
        assert r["measured_samples_per_s"] > 0
    assert "## Validation: predicted against measured on this machine" in proc.stdout
    assert "Order predicted:" in proc.stdout
    # what it assumes of other work on this machine: the load its probes were timed under
    assert "- outside load: other processes kept " in proc.stdout and "assumes the same load" in proc.stdout
    (runs,) = [d for d in (out / "validate").iterdir() if d.is_dir()]  # one experiment validated
    assert f"kanscale analyze {runs}" in proc.stdout
    # the peak compared is the strategy's own: no compute baseline's working memory in it
    assert {read_summary(p).measurement.baseline for p in runs.glob("*/summary.json")} == {"off"}
    report = subprocess.run(
        [sys.executable, "-m", "launchers.cli", "analyze", str(runs)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=child_env(),
        timeout=300,
    )
    assert report.returncode == 0, report.stderr[-2000:]
    page = (runs / "report" / "report.html").read_text()
    assert "Predicted by kanscale recommend, and measured" in page and "zero2" in page


@pytest.mark.slow  # three probe runs
def test_a_users_own_model_on_a_file_task_is_recommended_the_same_way(tmp_path):
    """examples/my_kan.py (no zoo family: its FSDP units are its own children) on a CSV of the
    user's, for the cluster file: ranked with exact model state, like the zoo."""
    import numpy as np

    rows = np.random.default_rng(0).uniform(-1, 1, size=(600, 4))
    (tmp_path / "houses.csv").write_text("a,b,c,price\n" + "\n".join(",".join(f"{v:.4f}" for v in r) for r in rows))
    out = tmp_path / "rec"
    proc = kanscale(
        "quickstart",
        "--set",
        f"task={{name: file, path: {tmp_path / 'houses.csv'}, target: price}}",
        "--set",
        'model={family: custom, widths: [3, 1], factory: "examples/my_kan.py:build", options: {hidden: [16]}}',
        "--cluster",
        str(CLUSTER),
        "--strategies",
        "ddp,fsdp2",
        "--global-batch",
        "256",
        "--json",
        str(out / "rec.json"),
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "rec.json").read_text())
    assert doc["model"].startswith("custom [3, 1]") and doc["pick"] is not None
    from kan_models import parse_model_config
    from strategies.experiment import load_strategy

    config = {"family": "custom", "widths": [3, 1], "factory": "examples/my_kan.py:build", "options": {"hidden": [16]}}
    shape = model_shape(config)
    assert shape.units and len(shape.units) >= 2  # the custom model's own children are its FSDP units
    for c in doc["ranking"]:
        m = load_strategy(c["strategy"], parse_model_config(config)).cost_model()
        assert c["model_state_bytes"] == sum(pj.model_state(m, shape, 2).values()) + 4 * len(shape.tensors)


def test_a_model_that_fits_nowhere_is_refused_naming_what_to_change(tmp_path):
    proc = kanscale(
        "quickstart",
        "--set",
        "model.widths=[2,4096,4096,1]",
        "--memory-per-device",
        "64MiB",
        "--strategies",
        "ddp,zero3",
        "--out",
        str(tmp_path / "rec"),
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "fits nowhere" in proc.stderr and "zero3, the least of the candidates" in proc.stderr
    # ZeRO-3 gathers every parameter for its step: more ranks would not make room, so it does not say so
    assert "more ranks do not help" in proc.stderr and "model.widths" in proc.stderr
    assert not (tmp_path / "rec").exists()


def test_the_ranks_a_refusal_names_fit_the_model_and_a_layer_too_wide_for_any_is_said_so():
    """The fix the refusal recommends, followed: at the ranks it names the model passes the check;
    and where a layer gathered whole cannot fit, it says more ranks do not help."""
    from kanscale.errors import ConfigError
    from launchers.recommend.advise import check_state_fits

    shape = model_shape({"family": "bspline", "widths": [2, 512, 512, 1], "grid": 5})
    models = {"ddp": strategy("ddp"), "zero3": strategy("zero3")}
    capacity = 10 * shape.trainable  # ZeRO-3: 20 bytes a parameter shared by the ranks, 8 gathered whole
    with pytest.raises(ConfigError) as refused:
        check_state_fits(models, shape, 2, 2, capacity, offload_on_device=True)
    ranks = int(str(refused.value).split("give at least ")[1].split()[0])
    check_state_fits(models, shape, ranks, 2, capacity, offload_on_device=True)  # fits: nothing raised
    with pytest.raises(ConfigError) as refused:
        check_state_fits(
            {"fsdp2": strategy("fsdp2")},
            model_shape({**MODEL, "widths": [2, 4096, 4096, 1]}),
            2,
            2,
            64 * 2**20,
            offload_on_device=True,
        )
    assert "more ranks do not help" in str(refused.value)
