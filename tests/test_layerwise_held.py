"""What the layerwise compute baseline holds, which a run takes off its peaks, is the tensors it
keeps (its units' captured inputs and buffers, its optimizer chunk and that chunk's state),
counted from them: never the working memory its steps freed, which the training reuses."""

import math

import torch

from kan_models.bspline import BSplineConfig
from kan_models.wrap import wrap_units
from strategies.measure.layerwise import LayerwiseBaseline
from strategies.sections import TrainingConfig


def test_held_bytes_are_the_kept_tensors_and_not_the_freed_working_memory():
    torch.manual_seed(0)
    model = BSplineConfig(family="bspline", widths=[8, 256, 256, 1], grid=10, k=3).build()
    training = TrainingConfig(micro_batch=512, steps=1)
    batches = [(torch.rand(512, 8) * 2 - 1, torch.rand(512, 1)) for _ in range(2)]
    units = wrap_units(model)
    baseline = LayerwiseBaseline(model, units, torch.device("cpu"), training, shard_degree=2, steps=1)
    baseline.warm_up(batches, 1024, lambda out, y: ((out - y) ** 2).sum(), steps=2)

    inputs = sum(len(batches) * 512 * unit_in * 4 for unit_in in (8, 256, 256)[: len(units)])
    buffers = sum(b.numel() * b.element_size() for unit in units for b in unit.buffers())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    chunk = math.ceil(trainable / 2) * 4  # one chunk here: the shard is below CHUNK elements
    adam = 2 * chunk + 8  # two moments and the step count
    # at most what it keeps: a unit's forward and backward over 1,024 samples frees tens of MiB,
    # none of which may be counted; at least its inputs, the chunk, its gradient and its moments
    assert inputs + 4 * chunk <= baseline.held_bytes <= inputs + buffers + 2 * chunk + adam + 64
