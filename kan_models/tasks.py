"""Tasks: what a model learns and how it is scored. A task owns its data, its output width,
its loss and its test metrics; the training loop and the measurements only call them and
never write a formula themselves.

The contract (:class:`TaskConfig`):

- ``output_dim``: the model's last width;
- ``loss_sum(prediction, target)``: the loss summed over the samples of a batch. A sum, not a
  mean, so that any split of a global batch into ranks and micro-batches adds up to the same
  number: the loop divides by the global batch size once;
- ``metric_sums(prediction, target)``: additive statistics of a test shard (summed over ranks);
- ``metrics(sums, n)``: the named test metrics from those sums over ``n`` samples.

The synthetic regression tasks here are standard KAN targets with data drawn deterministically
from a seed. Train inputs and test inputs come from two independent streams derived from the
seed, so the test set does not change when the number of training samples does. Gaussian noise
of ``noise_std`` is added to the training targets only; test MSE is measured against the
noise-free function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal, Union

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from kan_models.base import Interval


@dataclass(frozen=True)
class TaskData:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    def to(self, device: torch.device | str, dtype: torch.dtype) -> "TaskData":
        return TaskData(*(t.to(device=device, dtype=dtype) for t in (self.x_train, self.y_train, self.x_test, self.y_test)))


class TaskConfig(BaseModel):
    # no infinite or NaN floats (YAML's .inf, .nan): no noise level or input range means them
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str
    n_train: int = Field(10_000, ge=1, description="training samples")
    n_test: int = Field(2_000, ge=1, description="test samples")
    noise_std: float = Field(0.0, ge=0.0, description="std of Gaussian noise added to training targets")
    x_range: Interval = (-1.0, 1.0)

    @property
    def input_dim(self) -> int:
        raise NotImplementedError

    @property
    def output_dim(self) -> int:
        raise NotImplementedError

    def loss_sum(self, prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def metric_sums(self, prediction: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def metrics(self, sums: dict[str, float], n: int) -> dict[str, float]:
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


class RegressionTask(TaskConfig):
    """A scalar function of the inputs, learnt with the mean squared error and scored by the
    test MSE against the noise-free function."""

    @property
    def output_dim(self) -> int:
        return 1

    def loss_sum(self, prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Squared error summed over the samples (averaged over the outputs of each)."""
        return (prediction - target).pow(2).mean(dim=1).sum()

    def metric_sums(self, prediction: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"squared_error": self.loss_sum(prediction, target).double()}

    def metrics(self, sums: dict[str, float], n: int) -> dict[str, float]:
        return {"mse": sums["squared_error"] / n}


class QuadraticTask(RegressionTask):
    """The published study's task: f(x, y) = x^2 + y^2 on U[-2, 2]^2, noise std 0.01."""

    name: Literal["quadratic"]
    noise_std: float = Field(0.01, ge=0.0)
    x_range: Interval = (-2.0, 2.0)

    @property
    def input_dim(self) -> int:
        return 2

    def target(self, x: torch.Tensor) -> torch.Tensor:
        return (x**2).sum(dim=1, keepdim=True)


class ExpSinTask(RegressionTask):
    """KAN paper toy: f(x, y) = exp(sin(pi x) + y^2) on U[-1, 1]^2."""

    name: Literal["exp_sin"]

    @property
    def input_dim(self) -> int:
        return 2

    def target(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(torch.sin(math.pi * x[:, :1]) + x[:, 1:2] ** 2)


class HighDimTask(RegressionTask):
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
