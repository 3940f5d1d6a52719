"""MLP baseline, optionally sized so its trainable parameter count matches a KAN's."""

from __future__ import annotations

import itertools
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator
from torch import nn

from kan_models.base import LayerStack, ModelConfig, ParamCount, count_parameters
from kan_models.kan_families import parse_kan_config

ACTIVATIONS = {"silu": nn.SiLU, "relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}


def mlp_trainable_params(widths: list[int]) -> int:
    return sum((i + 1) * o for i, o in itertools.pairwise(widths))


def scale_hidden_widths(widths: list[int], target: int) -> list[int]:
    """Scale every hidden width by one common factor so the MLP's trainable parameter count is
    as close to ``target`` as integer widths allow."""
    if len(widths) < 3:
        return list(widths)

    def widths_at(factor: float) -> list[int]:
        return [widths[0]] + [max(1, round(w * factor)) for w in widths[1:-1]] + [widths[-1]]

    low, high = 1e-6, 1.0
    while mlp_trainable_params(widths_at(high)) < target:
        high *= 2
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if mlp_trainable_params(widths_at(mid)) < target else (low, mid)
    candidates = [widths_at(low), widths_at(high)]
    return min(candidates, key=lambda w: abs(mlp_trainable_params(w) - target))


class MLPConfig(ModelConfig):
    """MLP baseline (Linear + activation per hidden layer)."""

    family: Literal["mlp"]
    activation: Literal["silu", "relu", "gelu", "tanh"] = "silu"
    match: dict[str, Any] | None = Field(
        None,
        description="a KAN model config without widths, e.g. {family: bspline, grid: 10, k: 3}: "
        "hidden widths are scaled so the trainable parameter count matches that KAN's at these widths",
    )

    @model_validator(mode="after")
    def _match_is_a_kan(self) -> MLPConfig:
        if self.match is not None:
            self.matched_config()  # validates the nested model config now, not at build time
        return self

    def matched_config(self) -> ModelConfig:
        if self.match is None:
            raise ValueError("this MLP matches no KAN (match is unset)")
        if self.match.get("family") == "mlp":
            raise ValueError("match must name a KAN family, not mlp")
        try:
            return parse_kan_config({**self.match, "widths": self.widths})
        except ValidationError as err:
            problems = "; ".join(f"match.{'.'.join(map(str, e['loc'][1:]))}: {e['msg']}" for e in err.errors())
            raise ValueError(problems) from None

    def resolved_widths(self) -> list[int]:
        if self.match is None:
            return list(self.widths)
        target = count_parameters(self.matched_config().build()).trainable
        return scale_hidden_widths(self.widths, target)

    def parameter_count(self) -> ParamCount:
        if self.match is None:
            return super().parameter_count()
        # the matched KAN is counted, not built, so a huge one is not allocated (nor a pykan one
        # built on the meta device, where it cannot be)
        widths = scale_hidden_widths(self.widths, self.matched_config().parameter_count().trainable)
        return self.model_copy(update={"widths": widths, "match": None}).parameter_count()

    def build(self) -> LayerStack:
        widths = self.resolved_widths()
        layers: list[nn.Module] = []
        for n, (i, o) in enumerate(itertools.pairwise(widths)):
            is_last = n == len(widths) - 2
            layers.append(
                nn.Linear(i, o) if is_last else nn.Sequential(nn.Linear(i, o), ACTIVATIONS[self.activation]())
            )
        return LayerStack(layers)
