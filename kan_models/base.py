"""What every zoo model shares: its config base class, the layer stack, parameter counting."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator
from torch import nn


def _increasing(interval: tuple[float, float]) -> tuple[float, float]:
    if not interval[0] < interval[1]:
        raise ValueError(f"must be [low, high] with low < high, got {list(interval)}")
    return interval


# A [low, high] range (a grid's span, a task's input range), refused unless low < high.
Interval = Annotated[tuple[float, float], AfterValidator(_increasing)]


class WrapPolicy(BaseModel):
    """Which submodules the FSDP strategies shard as one unit each (kan_models/wrap.py)."""

    model_config = ConfigDict(extra="forbid")

    classes: list[str] | None = Field(None, description="every submodule of these class names is a unit")
    min_params: int = Field(1, ge=1, description="without classes: each child module (inside containers) holding at "
                                                 "least this many parameters is a unit")


class ModelConfig(BaseModel):
    """Fields every family has. A family subclasses this, narrows ``family`` to a literal,
    adds its own options and implements :meth:`build`."""

    # no infinite or NaN floats (YAML's .inf, .nan): no option of a model means them
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # The options, besides family and widths, that decide the weights' shapes: an exported model
    # fits another experiment only where they agree (training.init_from).
    identity: ClassVar[tuple[str, ...]] = ()
    # The options the run record names as the model's resolution: its grid (intervals or centres)
    # and its order (spline order or polynomial degree), where the family has them.
    resolution: ClassVar[dict[str, str]] = {}

    family: str
    widths: list[int] = Field(description="layer widths including input and output, e.g. [2, 64, 1]")
    wrap: WrapPolicy | None = Field(None, description="the FSDP units; default: one per KAN layer for the zoo's families, "
                                                      "each child module with parameters for a custom model")

    @field_validator("widths")
    @classmethod
    def _at_least_two_positive(cls, widths: list[int]) -> list[int]:
        if len(widths) < 2:
            raise ValueError("needs at least an input and an output width, e.g. [2, 64, 1]")
        if any(w <= 0 for w in widths):
            raise ValueError("every width must be a positive integer")
        return widths

    def build(self) -> nn.Module:
        raise NotImplementedError

    def machine_choices(self, device_type: str) -> dict[str, str]:
        """What the family decides from the machine it runs on (an ``auto`` option), in words by
        option, for the run's record: the options themselves say only ``auto``."""
        return {}

    def sketch(self) -> nn.Module:
        """The model without allocating it: built on the meta device, whose tensors have shapes
        but no storage, so a model far too large for this machine is looked at in milliseconds
        (for the checks before launch)."""
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            torch.manual_seed(0)  # some constructors read the seed (pykan)
            return self.build()

    def parameter_count(self) -> ParamCount:
        return count_parameters(self.sketch())

    def check_shape(self, task: str, inputs: int, outputs: int) -> None:
        """Refuse, before launch, a model that does not map the task's ``inputs`` to its
        ``outputs``: a family builds the widths it is given, which the experiment checks against
        the task, so only a model built by other code (custom) is looked at."""

    def refits_grids(self) -> bool:
        """Whether the model has grids for ``training.grid_update_every`` to refit."""
        model = self.sketch()
        return bool(getattr(model, "supports_grid_update", hasattr(model, "update_grid")))

    def describe(self) -> str:
        """One line naming the model, e.g. ``bspline [2, 64, 1] grid=10 k=3``."""
        extras = self.model_dump(exclude={"family", "widths"}, exclude_none=True)
        return " ".join([self.family, str(self.widths)] + [f"{k}={v}" for k, v in extras.items()])


class LayerStack(nn.Module):
    """A feed-forward stack of KAN (or MLP) layers.

    ``layers`` is also the unit the sharding strategies wrap one by one (one FSDP unit per
    KAN layer), so every zoo model exposes its layers through :attr:`blocks`.
    """

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    @property
    def blocks(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    @property
    def supports_grid_update(self) -> bool:
        return all(hasattr(layer, "update_grid") for layer in self.layers)

    @torch.no_grad()
    def update_grid(self, x: torch.Tensor) -> None:
        """Refit every layer's grid to the activations that reach it (layer by layer, so each
        layer sees its input as produced by the already-updated layers before it)."""
        if not self.supports_grid_update:
            raise TypeError(f"{type(self.layers[0]).__name__} has no grid to update")
        for layer in self.layers:
            layer.update_grid(x)
            x = layer(x)


@dataclass(frozen=True)
class LayerSplit:
    """How tensor parallelism may cut one KAN layer (strategies/backends/tp_plan.py). Names are the
    layer's own parameters and buffers (``coef``, ``spline.weight``); a tensor named in neither
    map stays whole on every rank.

    A KAN layer is an elementwise expansion of each input followed by a contraction over inputs,
    so its outputs split like a linear layer's columns (``outputs``: each rank computes some
    outputs from the whole input) and its inputs like its rows (``inputs``: each rank contracts
    some inputs and the partial outputs are summed)."""

    outputs: dict[str, int]  # tensor -> its dimension along the layer's outputs
    inputs: dict[str, int] | None  # tensor -> its dimension along the inputs; None: needs the whole input
    once: tuple[str, ...] = ()  # added to the output after the contraction (a bias): one rank adds it


@dataclass(frozen=True)
class ParamCount:
    trainable: int
    total: int


def count_parameters(model: nn.Module) -> ParamCount:
    """Trainable = elements of parameters that require grad; total = elements of the whole
    state (parameters and buffers such as spline grids), which is how the published study counts
    pykan's non-trainable grid and mask tensors."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(t.numel() for t in model.state_dict().values())
    return ParamCount(trainable=trainable, total=total)
