"""The fast B-spline layer against the Cox-de Boor reference: values, every gradient, grid update,
state dicts, and the torch.compile path."""

import json
import subprocess
import sys

import pytest
import torch
from pydantic import ValidationError

from kan_models import build_model, parse_model_config
from kan_models.bspline_bases import basis_matrix, uniform_knots
from kan_models.bspline_fast import (
    FastBSplineFunction,
    FastBSplineKANLayer,
    blocks,
    is_uniform,
    pointwise_forward,
)
from kan_models.bspline_reference import BSplineKANLayer
from kan_models.compile import compile_model
from tests.helpers.bspline_layers import GRADIENTS, HIGH, LOW, outputs_and_grads, probe_points, reference_layer


def assert_agree(got: list[torch.Tensor], want: list[torch.Tensor], dtype: torch.dtype) -> None:
    """float64: 1e-10 absolute; float32: 1e-5 relative to the largest reference value."""
    for name, g, w in zip(GRADIENTS, got, want, strict=True):
        tol = 1e-10 if dtype == torch.float64 else 1e-5 * float(w.detach().abs().max())
        err = float((g - w).abs().max().detach())
        assert err <= tol, f"{name}: max error {err:.2e} > {tol:.2e}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("grid", [1, 5, 10])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_fast_layer_matches_reference_inside_on_knots_and_outside(dtype, grid, k):
    ref = reference_layer(grid, k, dtype)
    fast = FastBSplineKANLayer(3, 4, grid, k, (LOW, HIGH)).to(dtype)
    fast.load_state_dict(ref.state_dict())
    x = probe_points(ref, dtype)
    assert_agree(outputs_and_grads(fast, fast, x), outputs_and_grads(ref, ref, x), dtype)


def test_blocked_computation_matches_reference_across_blocks():
    # Big enough for two blocks of input features and two of batch rows (see blocks()).
    n_in, n_out, grid, k, batch = 160, 1024, 10, 3, 1100
    col_blocks = blocks(batch, n_in, n_out, grid + k)
    assert len(col_blocks) > 1 and len(col_blocks[0][1]) > 1
    torch.manual_seed(0)
    ref = BSplineKANLayer(n_in, n_out, grid, k, (LOW, HIGH)).double()
    with torch.no_grad():
        ref.knots.copy_(uniform_knots(grid, k, LOW, HIGH, n_in))
    fast = FastBSplineKANLayer(n_in, n_out, grid, k, (LOW, HIGH)).double()
    fast.load_state_dict(ref.state_dict())
    x = torch.rand(batch, n_in, dtype=torch.float64) * 4 - 1.5
    assert_agree(outputs_and_grads(fast, fast, x), outputs_and_grads(ref, ref, x), torch.float64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("grid,k", [(1, 1), (5, 2), (10, 3), (4, 5)])
def test_compiled_form_matches_reference(dtype, grid, k):
    # The form torch.compile runs, evaluated eagerly. For k = 1 the slope jumps at knots and
    # this form rounds an input on a knot into either cell, so x-gradients are compared off knots.
    ref = reference_layer(grid, k, dtype)
    x = probe_points(ref, dtype)
    if k == 1:
        x = x[
            ~torch.isin(x[:, 0], ref.knots[0]) & ~torch.isin(x[:, 1], ref.knots[0]) & ~torch.isin(x[:, 2], ref.knots[0])
        ]
    compiled_form = lambda x: pointwise_forward(x, ref.knots, ref.coef, ref.scale_base, ref.scale_spline, k)  # noqa: E731
    assert_agree(outputs_and_grads(compiled_form, ref, x), outputs_and_grads(ref, ref, x), dtype)


def test_basis_is_zero_outside_partial_on_the_extension_and_one_inside():
    layer = FastBSplineKANLayer(1, 1, grid=4, k=3, grid_range=(-1.0, 1.0)).double()
    inside = torch.linspace(-1.0, 1.0, 101, dtype=torch.float64).unsqueeze(1)
    torch.testing.assert_close(layer.basis(inside).sum(-1), torch.ones(101, 1, dtype=torch.float64), atol=1e-14, rtol=0)
    assert layer.basis(torch.tensor([[-3.0], [2.5], [1e30], [-1e30]], dtype=torch.float64)).abs().max() == 0
    partial = layer.basis(torch.tensor([[-1.2], [1.3]], dtype=torch.float64)).sum(-1)
    assert torch.all((partial > 0) & (partial < 1))


def test_cubic_basis_matrix_is_the_textbook_one():
    value, slope = basis_matrix(3)
    # rows: powers of r; columns: B_{c-3} .. B_c = (1-r)^3/6, (3r^3-6r^2+4)/6, (-3r^3+3r^2+3r+1)/6, r^3/6
    want = [[1 / 6, 4 / 6, 1 / 6, 0], [-3 / 6, 0, 3 / 6, 0], [3 / 6, -6 / 6, 3 / 6, 0], [-1 / 6, 3 / 6, -3 / 6, 1 / 6]]
    as64 = lambda rows: torch.tensor(rows, dtype=torch.float64)  # noqa: E731
    torch.testing.assert_close(as64(value), as64(want), atol=1e-15, rtol=0)
    torch.testing.assert_close(
        as64(slope), as64([[(a + 1) * c for c in want[a + 1]] for a in range(3)]), atol=1e-15, rtol=0
    )


@pytest.mark.parametrize("k", [1, 2, 3])
def test_gradcheck_and_gradgradcheck_float64(k):
    torch.manual_seed(k)
    knots = uniform_knots(4, k, -1.0, 1.0, 3)
    # off the knots (finite differences straddling a k = 1 kink would disagree), some outside
    x = (torch.rand(6, 3, dtype=torch.float64) * 3.6 - 1.8).requires_grad_()
    params = [
        torch.randn(2, 3, 4 + k, dtype=torch.float64, requires_grad=True),
        torch.randn(2, 3, dtype=torch.float64, requires_grad=True),
        torch.randn(2, 3, dtype=torch.float64, requires_grad=True),
    ]

    def f(x, coef, scale_base, scale_spline):
        return FastBSplineFunction.apply(x, knots, coef, scale_base, scale_spline, k)

    assert torch.autograd.gradcheck(f, (x, *params))
    assert torch.autograd.gradgradcheck(f, (x, *params))


def test_grid_update_refits_to_a_uniform_grid_and_keeps_outputs():
    torch.manual_seed(0)
    layer = FastBSplineKANLayer(3, 4, grid=8, k=3, grid_range=(-1.0, 1.0)).double()
    with torch.no_grad():  # a trained-looking, smooth spline
        layer.coef.copy_(
            torch.sin(torch.linspace(0, 3, 11, dtype=torch.float64)).expand(4, 3, 11) * torch.rand(4, 3, 1)
        )
    x = (torch.randn(2000, 3, dtype=torch.float64) * 0.4).clamp(-0.95, 0.95)
    before = layer(x)
    layer.update_grid(x)
    after = layer(x)
    assert is_uniform(layer.knots)
    torch.testing.assert_close(layer.knots[:, 3], x.min(0).values)  # the grid now spans the data
    torch.testing.assert_close(layer.knots[:, -4], x.max(0).values)
    rel = (after - before).norm() / before.norm()
    assert rel < 1e-2, f"outputs moved by {rel:.2e} relative"


def test_grid_update_follows_data_outside_the_initial_range():
    torch.manual_seed(1)
    layer = FastBSplineKANLayer(2, 1, grid=5, k=3, grid_range=(-1.0, 1.0))
    x = torch.rand(500, 2) * 6 - 3
    layer.update_grid(x)
    inner = layer.knots[:, 3:-3]
    assert torch.all(inner[:, 0] <= -2.9) and torch.all(inner[:, -1] >= 2.9)
    assert is_uniform(layer.knots)


def study(impl: str) -> dict:
    return {"family": "bspline", "widths": [2, 6, 1], "grid": 5, "k": 3, "impl": impl}


def test_impl_option_selects_the_layer_and_fast_is_the_default():
    default = parse_model_config({"family": "bspline", "widths": [2, 1]})
    assert default.impl == "fast"
    assert all(type(b) is FastBSplineKANLayer for b in build_model(default, 0).blocks)
    assert all(type(b) is BSplineKANLayer for b in build_model(parse_model_config(study("reference")), 0).blocks)
    with pytest.raises(ValidationError, match="impl"):
        parse_model_config(study("cuda"))


@pytest.mark.parametrize("source,target", [("reference", "fast"), ("fast", "reference")])
def test_state_dicts_load_across_implementations(source, target):
    src = build_model(parse_model_config(study(source)), seed=3)
    dst = build_model(parse_model_config(study(target)), seed=4)
    assert {n: t.shape for n, t in src.state_dict().items()} == {n: t.shape for n, t in dst.state_dict().items()}
    dst.load_state_dict(src.state_dict())
    x = torch.rand(64, 2) * 2.4 - 1.2
    for model in (src, dst):
        model.zero_grad()
        model(x).square().sum().backward()
    torch.testing.assert_close(dst(x), src(x), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(src.named_parameters(), dst.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_fast_layer_refuses_non_uniform_knots():
    ref = build_model(parse_model_config(study("reference")), seed=0)
    ref.update_grid(torch.randn(256, 2) ** 3)  # grid_eps 0.02: mostly quantile knots
    with pytest.raises(RuntimeError, match=r"not uniform.*impl=reference"):
        build_model(parse_model_config(study("fast")), seed=0).load_state_dict(ref.state_dict())


def test_compile_model_compiles_in_place_times_it_and_matches_eager():
    cfg = parse_model_config({"family": "bspline", "widths": [2, 4, 1], "grid": 3, "k": 3})
    eager, model = build_model(cfg, seed=0), build_model(cfg, seed=0)
    x = torch.rand(32, 2) * 2.4 - 1.2
    compiled, seconds = compile_model(model, x)
    assert compiled is model and seconds > 0
    assert all(p.grad is None for p in model.parameters())  # compiling left .grad alone
    assert list(model.state_dict()) == list(eager.state_dict())  # no _orig_mod. prefix
    torch.testing.assert_close(model(x), eager(x), rtol=1e-5, atol=1e-6)
    for m in (model, eager):
        m(x).square().sum().backward()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)


def saved_bytes(forward, x: torch.Tensor) -> int:
    storages = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward(x)
    return sum(storages.values())


def assert_compiled_matches_eager(cfg, x: torch.Tensor, atol: float, grad_atol: float) -> torch.nn.Module:
    """Build the model twice, compile one: outputs and parameter gradients on ``x`` agree."""
    eager, model = build_model(cfg, seed=0), build_model(cfg, seed=0)
    compile_model(model, x)
    torch.testing.assert_close(model(x), eager(x), rtol=1e-5, atol=atol)
    for m in (model, eager):
        m(x).square().sum().backward()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=grad_atol)
    return model


def test_a_compiled_layer_too_large_to_keep_its_bases_recomputes_them_and_matches_eager():
    from kan_models.bspline_fast import BLOCK_ELEMENTS

    cfg = parse_model_config({"family": "bspline", "widths": [64, 8], "grid": 10, "k": 3})
    x = torch.rand(BLOCK_ELEMENTS // (64 * 13) + 64, 64) * 2 - 1
    bases = x.numel() * 13 * 4
    model = assert_compiled_matches_eager(cfg, x, atol=1e-5, grad_atol=1e-4)
    # Inductor would keep (batch, in, G + k) bases; recomputing them keeps little more than x
    assert saved_bytes(model, x) < bases / 4


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("grid", [1, 5, 10])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_sparse_product_matches_reference_inside_on_knots_and_outside(dtype, grid, k):
    ref = reference_layer(grid, k, dtype)
    sparse = FastBSplineKANLayer(3, 4, grid, k, (LOW, HIGH), product="sparse").to(dtype)
    sparse.load_state_dict(ref.state_dict())
    x = probe_points(ref, dtype)
    assert_agree(outputs_and_grads(sparse, sparse, x), outputs_and_grads(ref, ref, x), dtype)


def test_the_sparse_product_matches_reference_across_blocks():
    n_in, n_out, grid, k, batch = 160, 1024, 10, 3, 1100
    assert len(blocks(batch, n_in, n_out, grid + k)) > 1
    torch.manual_seed(0)
    ref = BSplineKANLayer(n_in, n_out, grid, k, (LOW, HIGH)).double()
    with torch.no_grad():
        ref.knots.copy_(uniform_knots(grid, k, LOW, HIGH, n_in))
    sparse = FastBSplineKANLayer(n_in, n_out, grid, k, (LOW, HIGH), product="sparse").double()
    sparse.load_state_dict(ref.state_dict())
    x = torch.rand(batch, n_in, dtype=torch.float64) * 4 - 1.5
    assert_agree(outputs_and_grads(sparse, sparse, x), outputs_and_grads(ref, ref, x), torch.float64)


def test_auto_multiplies_sparsely_from_the_default_crossover_where_this_cpu_measured_none(tmp_path, monkeypatch):
    from kan_models import sparse_crossover
    from kan_models.bspline_fast import use_sparse

    monkeypatch.setenv("KANSCALE_CACHE_DIR", str(tmp_path))
    sparse_crossover.cpu_crossover.cache_clear()
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    at = sparse_crossover.DEFAULT.bases_per_nonzero
    assert sparse_crossover.cpu_crossover() == sparse_crossover.DEFAULT
    assert use_sparse("auto", int(at * 4), 3, cpu) and not use_sparse("auto", int(at * 4) - 1, 3, cpu)
    assert not use_sparse("auto", 1000, 3, cuda)  # not measured on GPUs: dense unless asked
    assert use_sparse("sparse", 4, 3, cpu) and not use_sparse("dense", 1000, 3, cpu)
    layers = build_model(parse_model_config({"family": "bspline", "widths": [2, 1], "grid": 80, "k": 3}), 0).blocks
    assert layers[0].product == "auto"
    with pytest.raises(ValidationError, match="product sparse is a choice of the fast layer"):
        parse_model_config({"family": "bspline", "widths": [2, 1], "impl": "reference", "product": "sparse"})


def test_auto_follows_the_crossover_this_cpu_measured_and_says_so(tmp_path, monkeypatch):
    """The crossover moves with the CPU (docs/performance.md): a stored measurement for this CPU and
    torch decides; one stored for another CPU does not."""
    from kan_models import sparse_crossover
    from kan_models.bspline_fast import use_sparse

    monkeypatch.setenv("KANSCALE_CACHE_DIR", str(tmp_path))
    cpu = torch.device("cpu")
    config = parse_model_config({"family": "bspline", "widths": [2, 1], "grid": 21, "k": 3})  # 6 bases per non-zero
    sparse_crossover.save_crossover(5.6, "2026-12-02", [])
    store = json.loads((tmp_path / "sparse_crossover.json").read_text())
    assert list(store) == [sparse_crossover.machine_key()]
    assert use_sparse("auto", 24, 3, cpu) and not use_sparse("auto", 22, 3, cpu)
    assert config.machine_choices("cpu")["product"].startswith(
        "sparse: 6.0 bases per non-zero against a crossover of 5.6 bases per non-zero (measured on this CPU"
    )
    (tmp_path / "sparse_crossover.json").write_text(
        json.dumps({"Another CPU | torch 2.13.0": store[sparse_crossover.machine_key()]})
    )
    sparse_crossover.cpu_crossover.cache_clear()
    assert sparse_crossover.cpu_crossover() == sparse_crossover.DEFAULT and not use_sparse("auto", 24, 3, cpu)
    assert config.machine_choices("cpu")["product"].startswith(
        "dense: 6.0 bases per non-zero against a crossover of 20.0"
    )
    sparse_crossover.cpu_crossover.cache_clear()


def test_the_break_even_is_interpolated_between_the_measured_grids():
    from kan_models.sparse_crossover import break_even

    assert break_even([(10.8, 1.73), (3.2, 0.67)]) == pytest.approx(3.2 + 0.33 / 1.06 * 7.6)
    assert break_even([(3.2, 0.5), (10.8, 0.9)]) is None  # sparse never won: nothing to store
    assert break_even([(3.2, 1.1), (10.8, 2.0)]) == 3.2


def test_the_crossover_script_stores_what_it_printed(tmp_path):
    from tests.helpers.launch import ROOT, child_env

    cmd = [
        sys.executable,
        str(ROOT / "scripts/bench_sparse_crossover.py"),
        "--inputs",
        "64",
        "--outputs",
        "128",
        "--batch",
        "256",
        "--grids",
        "10",
        "400",
        "--repeats",
        "2",
        "--save",
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env=child_env(KANSCALE_CACHE_DIR=str(tmp_path))
    )
    store = tmp_path / "sparse_crossover.json"
    if proc.returncode == 1:  # a machine where torch's CSR products never beat the GEMM at this size
        assert "sparse never won up to grid 400" in proc.stdout and not store.exists()
        return
    assert proc.returncode == 0, proc.stderr
    printed = float(proc.stdout.split("break even at ")[1].split()[0])
    (entry,) = json.loads(store.read_text()).values()
    assert entry["bases_per_nonzero"] == printed and [r["grid"] for r in entry["table"]] == [
        10,
        400,
    ]


def test_a_compiled_model_runs_its_sparse_layers_eagerly_and_matches():
    cfg = parse_model_config({"family": "bspline", "widths": [3, 4, 1], "grid": 5, "k": 3, "product": "sparse"})
    assert_compiled_matches_eager(cfg, torch.rand(64, 3) * 2 - 1, atol=1e-6, grad_atol=1e-6)
