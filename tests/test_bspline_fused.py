"""The fused B-spline layer (``model.impl: fused``, kan_models/fused): the C++ op against the
Cox-de Boor reference, forward and every gradient, over grids 3-200, orders 1-5, odd widths,
inputs on every knot and outside the grid, in float64, float32 and bfloat16; double-precision
gradient checks of its backward; one op in a compiled graph; and training under the strategies."""

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from kan_models import build_model, parse_model_config
from kan_models.bspline_bases import uniform_knots
from kan_models.bspline_fast import FastBSplineKANLayer
from kan_models.bspline_reference import BSplineKANLayer
from kan_models.fused import FusedBSplineKANLayer, fused_layer, spline_term
from tests.helpers.bspline_layers import (
    HIGH,
    LOW,
    fused_like,
    outputs_and_grads,
    probe_points,
    reference_layer,
    relative_errors,
)
from tests.helpers.launch import run_here, run_jobs

GRIDS = [3, 10, 50, 200]
ORDERS = [1, 2, 3, 4, 5]


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("k", ORDERS)
def test_fused_layer_matches_the_reference_inside_on_knots_and_outside(grid, k):
    """float64: within 1e-12 of the largest value, for the output and the gradients of x, the
    coefficients and both scales. float32, against that float64 truth: 1e-6 is within reach of no
    float32 layer at large grids (the reference's own error reaches 7e-6 at G = 200, the fast
    layer's 4e-5), so within 4 times the reference's own rounding (measured: at most 3.8 times)."""
    ref = reference_layer(grid, k, torch.float64)
    x = probe_points(ref, torch.float64)
    truth = outputs_and_grads(ref, ref, x)
    fused = fused_like(ref)
    assert max(relative_errors(outputs_and_grads(fused, fused, x), truth).values()) <= 1e-12
    ref32 = copy.deepcopy(ref).float()
    fused32 = fused_like(ref32)
    own = max(relative_errors(outputs_and_grads(ref32, ref32, x.float()), truth).values())
    errors = relative_errors(outputs_and_grads(fused32, fused32, x.float()), truth)
    assert max(errors.values()) <= max(4 * own, 1e-6), (errors, own)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_odd_widths_and_a_batch_of_one(k):
    torch.manual_seed(k)
    ref = BSplineKANLayer(5, 7, 13, k, (LOW, HIGH)).double()
    with torch.no_grad():
        ref.knots.copy_(uniform_knots(13, k, LOW, HIGH, 5))
        for p in ref.parameters():
            p.copy_(torch.randn_like(p))
    fused = fused_like(ref)
    for x in (torch.rand(17, 5, dtype=torch.float64) * 5 - 2, torch.rand(1, 5, dtype=torch.float64)):
        errors = relative_errors(outputs_and_grads(fused, fused, x), outputs_and_grads(ref, ref, x))
        assert max(errors.values()) <= 1e-12, errors


@pytest.mark.parametrize(
    "n_in,n_out,dtype",
    [
        (37, 70, torch.float64),  # tiles of 32 float64 outputs, 6 outputs past them for the rows
        (9, 45, torch.float64),  # the input gradient's vectors (8) reach past the tiles: two splits
        (5, 83, torch.float32),  # tiles of 64 float32 outputs, 3 vectors of 16 and 3 outputs past them
    ],
)
def test_wide_layers_tiles_and_the_rows_past_them_match_the_reference(n_in, n_out, dtype):
    """Outputs enough for the kernels' register tiles, and some past them for narrow.h's rows,
    which add their share of the input gradient to the tiles'. float64 within 1e-12 of the
    largest value; float32 within 1e-5 (its own rounding over up to 83 outputs)."""
    torch.manual_seed(n_out)
    ref = BSplineKANLayer(n_in, n_out, 10, 3, (LOW, HIGH)).double()
    with torch.no_grad():
        ref.knots.copy_(uniform_knots(10, 3, LOW, HIGH, n_in))
        for p in ref.parameters():
            p.copy_(torch.randn_like(p))
    x = torch.rand(50, n_in, dtype=torch.float64) * 5 - 2.5  # inside and outside the grid
    truth = outputs_and_grads(ref, ref, x)
    fused = fused_like(copy.deepcopy(ref).to(dtype))
    errors = relative_errors(outputs_and_grads(fused, fused, x.to(dtype)), truth)
    assert max(errors.values()) <= (1e-12 if dtype == torch.float64 else 1e-5), errors


@pytest.mark.parametrize("k", [2, 3])
def test_bfloat16_is_closer_to_the_float32_function_than_the_fast_layer(k):
    """bf16 parameters (the knots float32, as every backend keeps buffers), against the float32
    reference with the same rounded parameters: the output within bf16's rounding; the gradients
    (measured 3-7% off, the reference's own bf16 arithmetic 1-2.5%) no further off than the fast
    layer's (7-14%), since the op computes in float32 and rounds once."""
    ref = reference_layer(10, k, torch.float32)
    rounded = copy.deepcopy(ref).to(torch.bfloat16)
    rounded.knots = ref.knots.clone()
    truth_layer = copy.deepcopy(rounded).float()
    x = probe_points(ref, torch.float32).to(torch.bfloat16)
    truth = outputs_and_grads(truth_layer, truth_layer, x.float())
    fused = fused_like(rounded)
    fast = FastBSplineKANLayer(3, 4, 10, k, (LOW, HIGH)).to(torch.bfloat16)
    fast.load_state_dict(rounded.state_dict())
    got = outputs_and_grads(fused, fused, x)
    errors, fast_errors = relative_errors(got, truth), relative_errors(outputs_and_grads(fast, fast, x), truth)
    assert got[0].dtype == torch.bfloat16 and errors["output"] <= 1e-2, errors
    assert all(errors[n] <= fast_errors[n] + 1e-3 for n in errors), (errors, fast_errors)


@pytest.mark.parametrize("k", [1, 3])
def test_the_ops_backward_passes_gradcheck(k):
    torch.manual_seed(0)
    n_in, n_out, grid = 3, 2, 4
    knots = uniform_knots(grid, k, LOW, HIGH, n_in).double()
    x = (torch.rand(6, n_in, dtype=torch.float64) * 3.5 - 1.2).requires_grad_()
    coef = torch.randn(n_out, n_in, grid + k, dtype=torch.float64, requires_grad=True)
    scale = torch.randn(n_out, n_in, dtype=torch.float64, requires_grad=True)
    # k = 1 has kinks at the knots: keep the points off them for finite differences
    assert torch.autograd.gradcheck(lambda *a: spline_term(*a[:1], knots, *a[1:], k), (x, coef, scale))


@pytest.mark.parametrize("k", [1, 3])
def test_the_whole_layer_passes_gradcheck_and_is_what_eager_cpu_steps_run(k):
    """fused_layer: the layer, SiLU base path included, in one C++ call each way (csrc/function.cpp),
    with gradients for x, the coefficients and both scales; the layer takes it in an eager step on
    a CPU (one autograd node), and the op with the base path beside it when compiled (below)."""
    torch.manual_seed(0)
    n_in, n_out, grid = 3, 5, 4  # more outputs than inputs: scale_base's gradient the other way round
    knots = uniform_knots(grid, k, LOW, HIGH, n_in).double()
    x = (torch.rand(6, n_in, dtype=torch.float64) * 3.5 - 1.2).requires_grad_()
    coef = torch.randn(n_out, n_in, grid + k, dtype=torch.float64, requires_grad=True)
    scale_spline, scale_base = (torch.randn(n_out, n_in, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(
        lambda x, c, s, b: fused_layer(x, knots, c, s, b, k), (x, coef, scale_spline, scale_base)
    )
    layer = FusedBSplineKANLayer(n_in, n_out, grid, k, (LOW, HIGH)).double()
    assert layer(x).grad_fn.name() == "torch::autograd::CppNode<kanscale::FusedLayer>"  # no Python in backward


def test_the_base_paths_float32_gradients_are_as_close_as_torchs_own_silu_at_any_input():
    """The backward's silu and silu' come from one exp of 16 lanes (csrc/silu.h, its own polynomial,
    its input clamped to [-87, 88]): over inputs from -100 to 100, the clamp's edges, zero and tiny
    ones, in a batch whose 3 x 37 inputs end in a partial vector, the gradients of x and scale_base are
    as close to the float64 truth as torch's float32 silu and silu_backward make them."""
    torch.manual_seed(0)
    edges = torch.tensor([0.0, 1e-30, -1e-30, 1e-4, -1e-4, 87.0, -87.0, 88.5, -88.5, 100.0, -100.0, 5.0, -5.0])
    x = torch.cat([edges, torch.linspace(-100, 100, 3 * 37 - len(edges))]).reshape(3, 37)
    knots = uniform_knots(4, 3, LOW, HIGH, 37).float()
    coef, scale_spline = torch.zeros(2, 37, 7), torch.ones(2, 37)  # no spline term: the base path alone
    scale_base, grad = torch.randn(2, 37), torch.randn(3, 2)

    def gradients(fn, dtype):
        leaves = [t.to(dtype, copy=True).requires_grad_() for t in (x, scale_base)]
        fn(*leaves).backward(grad.to(dtype))
        return [t.grad.double() for t in leaves]

    truth = gradients(lambda x, b: F.silu(x) @ b.t(), torch.float64)
    torch32 = gradients(lambda x, b: F.silu(x) @ b.t(), torch.float32)
    fused = gradients(lambda x, b: fused_layer(x, knots, coef, scale_spline, b, 3), torch.float32)
    for got, own, want in zip(fused, torch32, truth, strict=True):
        assert (got - want).abs().max() <= 2 * (own - want).abs().max() + 1e-6 * want.abs().max()


def test_a_compiled_model_runs_the_op_as_one_graph_and_matches_eager():
    cfg = parse_model_config({"family": "bspline", "widths": [2, 16, 1], "impl": "fused"})
    eager, model = build_model(cfg, 0), build_model(cfg, 0)
    compiled = torch.compile(model, fullgraph=True)  # fullgraph: a break would raise
    x = torch.rand(64, 2) * 2 - 1
    torch.testing.assert_close(compiled(x), eager(x), rtol=1e-6, atol=1e-7)
    compiled(x).square().sum().backward()
    eager(x).square().sum().backward()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_the_fused_layer_refuses_a_device_it_has_no_kernel_for():
    layer = FusedBSplineKANLayer(2, 3, 5, 3, (LOW, HIGH)).to("meta")
    with pytest.raises(RuntimeError, match=r"model\.impl: fused runs on CPUs .* set model\.impl=fast"):
        layer(torch.zeros(4, 2, device="meta"))


STRATEGIES = {
    "ddp": {"name": "ddp"},
    "fsdp2": {"name": "fsdp2"},
    "zero2": {"name": "deepspeed", "zero_stage": 2},
    "zero3": {"name": "deepspeed", "zero_stage": 3},
    "tp": {"name": "tp"},
}


def fused_experiment(strategy: dict, out: Path) -> dict:
    return {
        "name": "fused",
        "model": {"family": "bspline", "widths": [2, 8, 4, 1], "grid": 5, "impl": "fused", "grid_range": [-2.0, 2.0]},
        "task": {"name": "quadratic", "n_train": 640, "n_test": 96},
        "training": {
            "seed": 3,
            "lr": 2e-2,
            "micro_batch": None,
            "global_batch": 64,
            "steps": 10,
            "warmup_steps": 1,
            "grid_update_every": 4,
        },
        "strategy": strategy,
        "measurement": {"baseline_steps": 1},
        "runtime": {"device": "cpu", "threads": 1},
        "output": {"dir": str(out)},
    }


@pytest.mark.slow
def test_every_strategy_trains_the_fused_layer_with_the_single_process_losses(tmp_path):
    """The op on plain tensors (DDP, DeepSpeed), on FSDP2's unsharded parameters and inside
    tensor parallelism's local_map: per-step losses within 1e-5 of one process's, grid updates included."""
    reference = [s.loss for s in run_here(fused_experiment({"name": "single"}, tmp_path / "single")).combined]
    results = run_jobs(
        [{"id": key, "config": fused_experiment(s, tmp_path / "runs")} for key, s in STRATEGIES.items()], tmp_path
    )
    for key in STRATEGIES:
        losses = results[key]["losses"]
        assert results[key]["status"] == "ok" and results[key]["ranks_identical"], key
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True)) < 1e-5, key


def test_without_a_compiler_fused_is_refused_naming_the_fast_layer(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # where nothing is built
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(
        ValidationError,
        match=r"impl fused cannot be built here: no C\+\+ compiler \(no-such-compiler\).*set impl=fast",
    ):
        parse_model_config({"family": "bspline", "widths": [2, 4, 1], "impl": "fused"})
    assert parse_model_config({"family": "bspline", "widths": [2, 4, 1], "impl": "fast"}).impl == "fast"


def test_auto_fuses_on_cpus_and_is_the_fast_layer_elsewhere_or_without_a_compiler(monkeypatch, tmp_path):
    """impl: auto builds the fused layer where the op is built, and says so in the record's
    machine_choices; on a device it is not measured faster on (CUDA) it computes the fast layer's
    function by the fast layer's code; without a compiler it is the fast layer, and says why."""
    config = parse_model_config({"family": "bspline", "widths": [3, 5, 2], "grid": 7, "impl": "auto"})
    model = build_model(config, 0)
    assert all(isinstance(layer, FusedBSplineKANLayer) for layer in model.layers)
    assert config.machine_choices("cpu")["impl"].startswith("fused: ")
    assert config.machine_choices("cuda")["impl"].startswith("fast: ")
    fast = build_model(parse_model_config({"family": "bspline", "widths": [3, 5, 2], "grid": 7}), 0)
    x = torch.rand(9, 3) * 2 - 1
    torch.testing.assert_close(model(x), fast(x), rtol=1e-5, atol=1e-6)
    elsewhere = fused_like(reference_layer(7, 3, torch.float32))
    elsewhere.fused_on = ()  # as auto's layer on a device outside AUTO_FUSED_ON: the fast layer's forward
    assert torch.equal(
        elsewhere(x[:, :1].expand(9, elsewhere.in_features).contiguous()),
        FastBSplineKANLayer.forward(elsewhere, x[:, :1].expand(9, elsewhere.in_features).contiguous()),
    )
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # where nothing is built
    monkeypatch.setenv("CXX", "no-such-compiler")
    without = parse_model_config({"family": "bspline", "widths": [3, 5, 2], "impl": "auto"})
    assert not isinstance(build_model(without, 0).layers[0], FusedBSplineKANLayer)
    assert (
        without.machine_choices("cpu")["impl"] == "fast: no C++ compiler (no-such-compiler) to build the fused "
        "B-spline op (set CXX, or install g++)"
    )
