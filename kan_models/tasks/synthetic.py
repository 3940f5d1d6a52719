"""Synthetic regression tasks: standard KAN targets with data drawn deterministically from a
seed, and the Feynman equations pykan ships as formulas.

Train inputs and test inputs come from two independent streams derived from the seed, so the test
set does not change when the number of training samples does. Gaussian noise of ``noise_std`` is
added to the training targets only; test metrics are measured against the noise-free function.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable
from functools import cache
from typing import Literal

import numpy as np
import torch
from pydantic import Field, model_validator

from kan_models.base import Interval
from kan_models.tasks.contract import OBJECTIVES, Objective, TaskConfig, TaskData
from kanscale.extras import require


class SyntheticTask(TaskConfig):
    """A scalar function of inputs drawn uniformly from ``x_range`` in every dimension."""

    n_train: int = Field(10_000, ge=1, description="training samples")
    n_test: int = Field(2_000, ge=2, description="test samples (at least 2: r2 is undefined on one)")
    noise_std: float = Field(0.0, ge=0.0, description="std of Gaussian noise added to training targets")
    x_range: Interval = (-1.0, 1.0)

    @property
    def goal(self) -> Objective:
        return OBJECTIVES["regression"]

    @property
    def output_dim(self) -> int:
        return 1

    def ranges(self) -> list[tuple[float, float]]:
        """Each input's [low, high]."""
        return [self.x_range] * self.input_dim

    def target(self, x: torch.Tensor) -> torch.Tensor:
        """The noise-free function, x (n, input_dim) -> (n, 1)."""
        raise NotImplementedError

    def generate(self, seed: int) -> TaskData:
        train_rng, test_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
        low, high = (np.array(bound) for bound in zip(*self.ranges(), strict=True))
        x_train = torch.from_numpy(train_rng.uniform(low, high, (self.n_train, self.input_dim)))
        x_test = torch.from_numpy(test_rng.uniform(low, high, (self.n_test, self.input_dim)))
        noise = torch.from_numpy(train_rng.normal(0.0, 1.0, (self.n_train, 1))) * self.noise_std
        return TaskData(x_train, self.target(x_train) + noise, x_test, self.target(x_test))


class QuadraticTask(SyntheticTask):
    """The published study's task: f(x, y) = x^2 + y^2 on U[-2, 2]^2, noise std 0.01."""

    name: Literal["quadratic"]
    noise_std: float = Field(0.01, ge=0.0)
    x_range: Interval = (-2.0, 2.0)

    @property
    def input_dim(self) -> int:
        return 2

    def target(self, x: torch.Tensor) -> torch.Tensor:
        return (x**2).sum(dim=1, keepdim=True)


class ExpSinTask(SyntheticTask):
    """KAN paper toy: f(x, y) = exp(sin(pi x) + y^2) on U[-1, 1]^2."""

    name: Literal["exp_sin"]

    @property
    def input_dim(self) -> int:
        return 2

    def target(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(torch.sin(math.pi * x[:, :1]) + x[:, 1:2] ** 2)


class HighDimTask(SyntheticTask):
    """KAN paper's high-dimensional target: f(x) = exp(mean_i sin^2(pi x_i / 2)) on U[-1, 1]^d,
    with d = ``input_dim`` (100 in the paper), for wide-input models."""

    name: Literal["high_dim"]
    dim: int = Field(100, ge=1, le=1_000_000, description="input dimension d")

    @property
    def input_dim(self) -> int:
        return self.dim

    def target(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(torch.sin(math.pi * x / 2).pow(2).mean(dim=1, keepdim=True))


@cache
def feynman_equation(equation: str) -> tuple[int, Callable[[torch.Tensor], torch.Tensor], list[tuple[float, float]]]:
    """pykan's Feynman equation ``equation`` (kan.feynman): its variable count, its function and
    each variable's range. Imported here: it pulls in sympy."""
    require("pykan", "task.name: feynman (pykan's equations)")
    from kan.feynman import get_feynman_dataset

    try:
        symbols, _, function, ranges = get_feynman_dataset(equation)
    except (NameError, UnboundLocalError):  # pykan's if-chain defines nothing for an unknown name
        names = feynman_names()
        raise ValueError(
            f"task.equation: {equation!r} is not one of pykan's Feynman equations ({', '.join(names[1:9])}, "
            f"...: the {len(names)} names in kan/feynman.py)"
        ) from None
    count = len(symbols) if isinstance(symbols, (list, tuple)) else 1
    if not isinstance(ranges[0], (list, tuple)):  # one range for every variable
        ranges = [ranges] * count
    return count, function, [(float(low), float(high)) for low, high in ranges]


def feynman_names() -> list[str]:
    """The equation names pykan's kan.feynman knows, in its order."""
    from kan import feynman

    return re.findall(r"name == '([^']+)'", inspect.getsource(feynman))


class FeynmanTask(SyntheticTask):
    """One of the Feynman equations pykan ships as formulas (``equation``, e.g. I.6.20a), with
    inputs drawn uniformly from pykan's ranges for its variables."""

    name: Literal["feynman"]
    equation: str = Field(description="pykan's name for it, e.g. I.6.20a, I.9.18, II.6.15a")

    @property
    def label(self) -> str:
        return f"feynman {self.equation}"

    @model_validator(mode="after")
    def _known(self) -> FeynmanTask:
        feynman_equation(self.equation)
        return self

    @property
    def input_dim(self) -> int:
        return feynman_equation(self.equation)[0]

    def ranges(self) -> list[tuple[float, float]]:
        return feynman_equation(self.equation)[2]

    def target(self, x: torch.Tensor) -> torch.Tensor:
        return feynman_equation(self.equation)[1](x).reshape(-1, 1).to(x.dtype)
