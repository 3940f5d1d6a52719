"""The zoo's models as ``kanscale commbench``, ``project`` and ``recommend`` see them: a model
config's parameter layout (the projection's ModelShape), and the model config a ``kanscale bench``
row measured."""

from __future__ import annotations

import contextlib
import io
from typing import Any

from torch import nn

from analysis.projection import ModelShape
from kan_models import build_model, parse_model_config
from kan_models.base import ModelConfig
from kan_models.wrap import wrap_units
from launchers.bench_catalog import implementation_config, split_impl


def model_shape(config: dict[str, Any]) -> ModelShape:
    """Parameter element counts of a zoo model: per trainable tensor, per sharding unit (the
    root's own parameters, then each KAN layer: what FSDP gathers one at a time), and the layer
    widths where tensor parallelism can cut its layers."""
    cfg = parse_model_config(config)
    model = meta_sketch(cfg) or build_model(cfg, seed=0)  # meta: a model too large for this machine, in milliseconds
    tensors = tuple(p.numel() for p in model.parameters() if p.requires_grad)
    blocks = wrap_units(model, cfg.wrap)  # what FSDP shards one at a time, for the zoo and a user's model alike
    layers = [sum(p.numel() for p in block.parameters() if p.requires_grad) for block in blocks]
    root = sum(tensors) - sum(layers)
    cuttable = bool(blocks) and all(hasattr(b, "layer_split") for b in blocks) and len(blocks) == len(cfg.widths) - 1
    return ModelShape(
        label=cfg.describe(),
        tensors=tensors,
        units=tuple(([root] if root else []) + layers),
        params=sum(p.numel() for p in model.parameters()),
        widths=tuple(cfg.widths) if cuttable else (),
    )


def meta_sketch(cfg: ModelConfig) -> nn.Module | None:
    """The model on the meta device (shapes, no storage), or None for a family that computes
    while it builds (pykan fits its splines by least squares, which meta tensors cannot)."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # pykan prints why its fit failed
            return cfg.sketch()
    except Exception:
        return None


def bench_model_config(doc: dict[str, Any], workload: str, impl: str) -> dict[str, Any]:
    """The model a row (``workload``, ``impl``) of a ``kanscale bench`` JSON measured."""
    size = doc["workloads"][workload]
    return implementation_config(split_impl(impl)[0], size["widths"], size["grid"], size["k"])
