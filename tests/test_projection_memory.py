"""The projection's model state per rank against what real runs record, per category and exactly:
every CPU strategy at 2 ranks (single at 1) under fp32 and bf16, so that the precision each
backend holds its parameters, gradients and masters in is the one predicted (docs/projection.md)."""

import json
from dataclasses import replace

import pytest

from analysis import projection as pj
from launchers.cli import main
from launchers.project import cost_models
from launchers.zoo import model_shape
from tests.helpers.launch import ROOT
from tests.helpers.parity import FAMILIES
from tests.helpers.records import make_record, write_record
from tests.helpers.state_runs import DISTRIBUTED, PRECISIONS


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("strategy", ["single", *DISTRIBUTED])
def test_model_state_equals_the_runs_record_per_category(state_runs, strategy, precision):
    (m,) = cost_models([strategy], FAMILIES["bspline"])
    shape = replace(model_shape(FAMILIES["bspline"]), precision=precision)
    ranks = 2 if m.multi_rank else 1
    predicted = pj.model_state(m, shape, ranks)
    record = state_runs[precision, strategy]["model_state"]
    # Adam's step counters are left to a measured one-rank run (StepMemory.counters): a 4-byte
    # count per tensor torch's Adam updates, one per flat partition under ZeRO 1-3
    counters = 4 * (1 if m.master else len(shape.tensors))
    assert {**predicted, "optimizer": predicted["optimizer"] + counters} == record


def test_the_precision_changes_only_what_a_module_cast_holds():
    """A strategy that casts the module (DeepSpeed) holds 16-bit parameters and gradients plus a
    master copy under bf16; autocast and FSDP's mixed precision predict the same bytes as fp32."""
    shape = model_shape(FAMILIES["bspline"])
    low = replace(shape, precision="bf16")
    for m in cost_models(["ddp", "fsdp2", "zero0", "zero3"], FAMILIES["bspline"]):
        full, mixed = pj.model_state(m, shape, 2), pj.model_state(m, low, 2)
        if not m.casts_module:
            assert mixed == full, m.label
            continue
        assert mixed["params"] == full["params"] / 2 and mixed["grads"] == full["grads"] / 2, m.label
        assert mixed["master_params"] == full["grads"] > 0, m.label  # fp32, as the gradients were


def test_project_predicts_the_model_state_in_the_profiles_precision(tmp_path, capsys):
    """``kanscale project`` from 1-rank runs predicts the state in the precision they trained in,
    and refuses runs of two precisions as two experiments."""
    cluster = str(ROOT / "configs/clusters/a100_ib.yaml")
    model = {"family": "bspline", "widths": [2, 8, 1], "grid": 5, "k": 3}
    (zero1,) = cost_models(["zero1"], model)
    for precision in PRECISIONS:
        write_record(tmp_path / precision, make_record(precision, strategy="single", precision=precision))
        out = tmp_path / f"{precision}.json"
        argv = ["--profile", str(tmp_path / precision), "--strategies", "zero1", "--ranks", "2", "--out", str(out)]
        assert main(["project", *argv, "--cluster", cluster]) == 0
        (row,) = [r for r in json.loads(out.read_text())["rows"] if r["ranks"] == 2]
        shape = replace(model_shape(model), precision=precision)
        assert row["state_bytes"] == sum(pj.model_state(zero1, shape, 2).values()), precision
    write_record(tmp_path / "both", make_record("a", strategy="single"))
    write_record(tmp_path / "both", make_record("b", strategy="single", precision="bf16"))
    assert main(["project", "--profile", str(tmp_path / "both"), "--ranks", "2", "--cluster", cluster]) == 2
    assert "2 experiments" in capsys.readouterr().err
