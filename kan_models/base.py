"""What every zoo model shares: its config base class, the layer stack, parameter counting."""

from __future__ import annotations

import functools
import itertools
import operator
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Protocol, Union, cast, get_args, get_origin

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError
from torch import nn


def _increasing(interval: tuple[float, float]) -> tuple[float, float]:
    if not interval[0] < interval[1]:
        raise ValueError(f"must be [low, high] with low < high, got {list(interval)}")
    return interval


# A [low, high] range (a grid's span, a task's input range), refused unless low < high.
Interval = Annotated[tuple[float, float], AfterValidator(_increasing)]

# A seed: NumPy's SeedSequence refuses a negative one, and pykan hands its seed to the legacy
# np.random.seed, which takes 0 <= seed < 2^32 only (torch.manual_seed takes up to 2^64 - 1).
Seed = Annotated[int, Field(ge=0, lt=2**32)]


class GridLayer(Protocol):
    """A layer whose grid follows the data (``LayerStack.update_grid`` checks that every layer has one)."""

    def update_grid(self, x: torch.Tensor) -> None: ...


def one_of(configs: Iterable[type], key: str) -> Any:
    """The field type that validates into one of ``configs``, chosen by the value of ``key`` (a
    registry's union). Built at run time from the registry's table, which a type checker cannot
    follow: the registries declare their union as the configs' base class to it."""
    return Annotated[functools.reduce(operator.or_, configs), Field(discriminator=key)]


def _options(annotation: Any) -> list[Any]:
    """The types an annotation admits, unions and Annotated unwrapped: ``int | None`` -> [int, None]."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _options(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return [option for arg in get_args(annotation) for option in _options(arg)]
    return [annotation]


def _number_wanted(option: Any) -> str | None:
    """What a number-typed option asks for, in words (None: it is not a number type)."""
    if option is int:
        return "an integer"
    if option is float:
        return "a number"
    values = get_args(option) if get_origin(option) is Literal else ()
    numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return f"one of {', '.join(map(str, numbers))}" if numbers else None


def booleans_as_numbers(value: Any, annotation: Any, loc: tuple = ()) -> Iterator[tuple[tuple, bool, str]]:
    """Each place in ``value`` where a field of type ``annotation`` would take a boolean for a
    number (pydantic's lax mode reads true as 1): its location (``()`` for the value itself,
    ``(1,)`` for item 1 of a list), the boolean, and what the field wants there, in words."""
    options = _options(annotation)
    if isinstance(value, bool):
        if not any(o is bool or o is Any or (get_origin(o) is Literal and value in get_args(o)) for o in options):
            wanted = next(filter(None, map(_number_wanted, options)), None)
            if wanted:
                yield loc, value, wanted
        return
    for option in options if isinstance(value, (list, tuple, dict)) else ():
        origin, args = get_origin(option), get_args(option)
        if isinstance(value, dict) and origin is dict and len(args) == 2:
            items = [(key, item, args[1]) for key, item in value.items()]
        elif not isinstance(value, dict) and origin in (list, tuple) and args:
            item_types = itertools.repeat(args[0]) if origin is list or args[-1] is Ellipsis else args
            items = [(i, item, item_type) for i, (item, item_type) in enumerate(zip(value, item_types, strict=False))]
        else:
            continue
        for key, item, item_type in items:
            yield from booleans_as_numbers(item, item_type, (*loc, key))
        return


class NumbersNotBooleans(BaseModel):
    """Base of every config class: a boolean given for a number (``micro_batch: true``,
    ``widths: [2, true, 1]``; YAML's yes and on are booleans too) is refused, naming the field,
    where pydantic's lax mode would silently take it as 1. Strict mode would refuse it too, but
    also a YAML list for a tuple field, which every config writes. (A model validator rather than
    a field validator: pydantic allows none of the latter on the family/name discriminators.)"""

    @model_validator(mode="before")
    @classmethod
    def _no_boolean_numbers(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        errors: list[InitErrorDetails] = [
            {
                "type": PydanticCustomError(
                    "bool_as_number",
                    "{given} is a boolean, not a number; give {wanted}",
                    {"given": str(flag).lower(), "wanted": wanted},
                ),
                "loc": (name, *where),
                "input": flag,
            }
            for name, field in cls.model_fields.items()
            if name in data
            for where, flag, wanted in booleans_as_numbers(data[name], field.annotation)
        ]
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return data


class WrapPolicy(NumbersNotBooleans):
    """Which submodules the FSDP strategies shard as one unit each (kan_models/wrap.py)."""

    model_config = ConfigDict(extra="forbid")

    classes: list[str] | None = Field(None, description="every submodule of these class names is a unit")
    min_params: int = Field(
        1,
        ge=1,
        description="without classes: each child module (inside containers) holding at "
        "least this many parameters is a unit",
    )


class ModelConfig(NumbersNotBooleans):
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
    wrap: WrapPolicy | None = Field(
        None,
        description="the FSDP units; default: one per KAN layer for the zoo's families, "
        "each child module with parameters for a custom model",
    )

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
            cast(GridLayer, layer).update_grid(x)
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
    pykan's non-trainable grid and mask tensors. A tensor shared by two modules (tied weights)
    counts once: the state dict names it under each, so its tensors are told apart by identity
    (keep_vars: the parameters and buffers themselves; on the meta device, where sketches are
    counted, there is no storage address to compare)."""
    state = {id(t): t for t in model.state_dict(keep_vars=True).values()}.values()
    trainable = sum(t.numel() for t in state if isinstance(t, nn.Parameter) and t.requires_grad)
    total = sum(t.numel() for t in state)
    return ParamCount(trainable=trainable, total=total)
