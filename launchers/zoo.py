"""The zoo's models as ``kanscale commbench`` and ``kanscale project`` see them: a model config's
parameter layout (the projection's ModelShape), and the model config a ``kanscale bench`` row
measured."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from analysis.projection import ModelShape
from kan_models import build_model, parse_model_config
from launchers.bench import implementation_config, split_impl


def model_shape(config: dict[str, Any]) -> ModelShape:
    """Parameter element counts of a zoo model: per trainable tensor, per sharding unit (the
    root's own parameters, then each KAN layer: what FSDP gathers one at a time), and the layer
    widths where tensor parallelism can cut its layers."""
    cfg = parse_model_config(config)
    model = build_model(cfg, seed=0)
    tensors = tuple(p.numel() for p in model.parameters() if p.requires_grad)
    layers = [sum(p.numel() for p in block.parameters() if p.requires_grad) for block in model.blocks]
    root = sum(tensors) - sum(layers)
    return ModelShape(label=cfg.describe(), tensors=tensors, units=tuple(([root] if root else []) + layers),
                      params=sum(p.numel() for p in model.parameters()),
                      widths=tuple(cfg.widths) if all(hasattr(b, "layer_split") for b in model.blocks) else ())


def bench_model_config(doc: dict[str, Any], workload: str, impl: str) -> dict[str, Any]:
    """The model a row (``workload``, ``impl``) of a ``kanscale bench`` JSON measured."""
    return implementation_config(split_impl(impl)[0], SimpleNamespace(**doc["workloads"][workload]))
