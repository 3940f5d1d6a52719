"""Synthetic regression tasks: standard KAN targets with data drawn deterministically from a seed.

Train inputs and test inputs come from two independent streams derived from the seed, so the
test set does not change when the number of training samples does. Gaussian noise of
``noise_std`` is added to the training targets only; test MSE is measured against the
noise-free function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal, Union

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator


@dataclass(frozen=True)
class TaskData:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    def to(self, device: torch.device | str, dtype: torch.dtype) -> "TaskData":
        return TaskData(*(t.to(device=device, dtype=dtype) for t in (self.x_train, self.y_train, self.x_test, self.y_test)))


class TaskConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    n_train: int = Field(10_000, ge=1, description="training samples")
    n_test: int = Field(2_000, ge=1, description="test samples")
    noise_std: float = Field(0.0, ge=0.0, description="std of Gaussian noise added to training targets")
    x_range: tuple[float, float] = (-1.0, 1.0)

    @model_validator(mode="after")
    def _range_increasing(self) -> "TaskConfig":
        if not self.x_range[0] < self.x_range[1]:
            raise ValueError(f"x_range must be [low, high] with low < high, got {list(self.x_range)}")
        return self

    @property
    def input_dim(self) -> int:
        raise NotImplementedError

    def target(self, x: torch.Tensor) -> torch.Tensor:
        """The noise-free function, x (n, input_dim) -> (n, 1)."""
        raise NotImplementedError

    def generate(self, seed: int) -> TaskData:
        train_rng, test_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
        low, high = self.x_range
        x_train = torch.from_numpy(train_rng.uniform(low, high, (self.n_train, self.input_dim)))
        x_test = torch.from_numpy(test_rng.uniform(low, high, (self.n_test, self.input_dim)))
        noise = torch.from_numpy(train_rng.normal(0.0, 1.0, (self.n_train, 1))) * self.noise_std
        return TaskData(x_train, self.target(x_train) + noise, x_test, self.target(x_test))


class QuadraticTask(TaskConfig):
    """The published study's task: f(x, y) = x^2 + y^2 on U[-2, 2]^2, noise std 0.01."""

    name: Literal["quadratic"]
    noise_std: float = Field(0.01, ge=0.0)
    x_range: tuple[float, float] = (-2.0, 2.0)

    @property
    def input_dim(self) -> int:
        return 2

    def target(self, x: torch.Tensor) -> torch.Tensor:
        return (x**2).sum(dim=1, keepdim=True)


class ExpSinTask(TaskConfig):
    """KAN paper toy: f(x, y) = exp(sin(pi x) + y^2) on U[-1, 1]^2."""

    name: Literal["exp_sin"]

    @property
    def input_dim(self) -> int:
        return 2

    def target(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(torch.sin(math.pi * x[:, :1]) + x[:, 1:2] ** 2)


class HighDimTask(TaskConfig):
    """KAN paper's high-dimensional target: f(x) = exp(mean_i sin^2(pi x_i / 2)) on U[-1, 1]^d,
    with d = ``input_dim`` (100 in the paper), for wide-input models."""

    name: Literal["high_dim"]
    dim: int = Field(100, ge=1, le=1_000_000, description="input dimension d")

    @property
    def input_dim(self) -> int:
        return self.dim

    def target(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(torch.sin(math.pi * x / 2).pow(2).mean(dim=1, keepdim=True))


TASKS: dict[str, type[TaskConfig]] = {
    "quadratic": QuadraticTask,
    "exp_sin": ExpSinTask,
    "high_dim": HighDimTask,
}

AnyTaskConfig = Annotated[Union[tuple(TASKS.values())], Field(discriminator="name")]
