"""The counted step of a run (strategies/measure/step_profile.py): its FLOPs per sample by torch's
formulas, and its tensors by category, in the record of a real one-process run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.launch import ROOT, child_env, run_here
from tests.helpers.parity import experiment


def record_of(tmp_path, model: dict, **training):
    config = experiment("bspline", {"name": "single"}, 1, str(tmp_path / "runs"), steps=3, **training)
    config["model"] = model
    config["task"] = {"name": "high_dim", "dim": 32, "n_train": 512, "n_test": 64}
    config["measurement"] = {"baseline": "off"}
    trainer = run_here(config)
    return trainer.record, trainer.model


def test_an_mlps_counted_flops_per_sample_are_six_times_its_weights(tmp_path):
    """Forward 2 FLOPs per weight and sample, backward 4 (the input's gradient and the weight's)."""
    record, model = record_of(tmp_path, {"family": "mlp", "widths": [32, 256, 256, 1]})
    weights = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    assert record.flops is not None and record.flops.step == 2  # the last warm-up step
    assert record.flops.model_per_sample == pytest.approx(6 * weights, rel=0.05)
    assert record.flops.hardware_per_sample == record.flops.model_per_sample  # nothing recomputed


def test_accumulated_micro_batches_are_counted_as_one_step(tmp_path):
    """Four micro-batches of a step are one step's forwards to the tracker, not four iterations
    (which torch's MemTracker refuses), and the same FLOPs per sample as one micro-batch."""
    rbf = {"family": "rbf", "widths": [32, 64, 1]}
    whole, _ = record_of(tmp_path / "one", rbf)
    accumulated, model = record_of(tmp_path / "four", rbf, grad_accum=4)
    assert accumulated.batch.grad_accum == 4 and accumulated.status == "ok"
    assert accumulated.flops.model_per_sample == pytest.approx(whole.flops.model_per_sample, rel=1e-9)
    # a quarter of the batch in flight at once: a quarter of the activations
    kept, quarter = whole.memory.activations_after_forward_bytes, accumulated.memory.activations_after_forward_bytes
    assert quarter == pytest.approx(kept / 4, rel=0.1)
    peak = accumulated.memory.step_peak
    assert peak.activations <= peak.peak
    assert peak.parameters == sum(p.numel() * p.element_size() for p in model.parameters())
    assert accumulated.memory.activation_checkpointing == "none" and accumulated.memory.checkpointed_units == 0


def test_the_tracker_is_imported_without_torchs_compiler():
    """MemTracker's module alone: its package's __init__ would import torch._inductor, most of a
    second in every rank that counts a step."""
    probe = (
        "import sys; from strategies.measure.tensor_memory import StepMemoryTracker; "
        "print(sorted(m for m in ('torch._inductor', 'torch._dynamo') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, env=child_env())
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
