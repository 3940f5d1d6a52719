"""The task contract every task implements, and the two objectives tasks learn.

A task owns its data, its widths, its loss and its test metrics; the training loop and the
measurements only call them and never write a formula themselves (:class:`TaskConfig`):

- ``input_dim``, ``output_dim``: the model's first and last widths;
- ``n_train``, ``n_test``: the sizes of its two splits;
- ``generate(seed)``: the data (:class:`TaskData`);
- ``loss_sum(prediction, target)``: the loss summed over the samples of a batch. A sum, not a
  mean, so that any split of a global batch into ranks and micro-batches adds up to the same
  number: the loop divides by the global batch size once;
- ``metric_sums(prediction, target)``: additive statistics of a test shard (tensors of any
  shape, summed over ranks);
- ``metrics(sums, n)``: the named test metrics from those sums over ``n`` samples.

The loss and metrics come from the task's ``goal``, an :class:`Objective`: regression (mean
squared error; mse, rmse and r2, and for targets the task standardised the errors in their own
units too: :func:`unscaled_metrics`) or classification (cross-entropy over class logits;
accuracy and log-loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import ConfigDict

from kan_models.base import NumbersNotBooleans


@dataclass(frozen=True)
class TaskData:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    def to(self, device: torch.device | str, dtype: torch.dtype) -> TaskData:
        """On ``device``, inputs and real-valued targets in ``dtype``; class labels stay integers."""

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device=device)

        return TaskData(*(move(t) for t in (self.x_train, self.y_train, self.x_test, self.y_test)))


class Objective:
    """What a task's model is trained to do: its loss and its test metrics."""

    name = ""

    def loss_sum(self, prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def metric_sums(self, prediction: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def metrics(self, sums: dict[str, torch.Tensor], n: int) -> dict[str, float]:
        raise NotImplementedError


class Regression(Objective):
    """Real-valued targets of any width: the squared error, averaged over the outputs of each
    sample and summed over samples; scored by mse, rmse and r2 (the coefficient of
    determination, averaged over outputs as scikit-learn does). Where an output's test targets
    have no spread (one test sample, a constant target) r2 is undefined, and it is left out rather
    than given a number (scikit-learn's force_finite would say 0 or 1): mse and rmse remain."""

    name = "regression"

    def loss_sum(self, prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # One op and one autograd node: (prediction - target).pow(2).mean(dim=1).sum() takes four,
        # enough at the study's size to make the suite's loop measurably slower than a hand-written
        # one (docs/models.md)
        squares = F.mse_loss(prediction, target, reduction="sum")
        return squares if prediction.shape[1] == 1 else squares / prediction.shape[1]

    def metric_sums(self, prediction: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        target = target.double()
        return {
            "squared_error": (prediction.double() - target).pow(2).sum(dim=0),
            "target": target.sum(dim=0),
            "target_squared": target.pow(2).sum(dim=0),
        }

    def metrics(self, sums: dict[str, torch.Tensor], n: int) -> dict[str, float]:
        error, total, squares = sums["squared_error"], sums["target"], sums["target_squared"]
        mse = float(error.sum()) / (n * error.numel())
        variance = squares - total.pow(2) / n  # n times each output's variance over the test set
        scores = {"mse": mse, "rmse": mse**0.5}
        # No spread is zero up to the rounding of the sums above: 999 samples of a constant 0.0137
        # leave 1.5e-16 of their squares, which 1 - error / variance turned into an r2 of -3.6e15.
        if bool((variance > 1e-12 * squares).all()):
            scores["r2"] = float((1 - error / variance).mean())
        return scores


def unscaled_metrics(sums: dict[str, torch.Tensor], n: int, mean: np.ndarray, scale: np.ndarray) -> dict[str, float]:
    """A regression's errors in its targets' own units, from the sums of :class:`Regression` over
    targets that were centred by ``mean`` and divided by ``scale`` (per output), and those two:
    what a user needs to read the scaled mse back. One output gives ``mse_unscaled``,
    ``rmse_unscaled``, ``target_mean``, ``target_std``; several give ``rmse_unscaled[j]``,
    ``target_mean[j]``, ``target_std[j]`` per output j, which may be in different units. (r2 is
    the same either way.)"""
    error = sums["squared_error"].double() * torch.from_numpy(np.asarray(scale, dtype=np.float64)).pow(2)
    if error.numel() == 1:
        mse = float(error.sum()) / n
        return {
            "mse_unscaled": mse,
            "rmse_unscaled": mse**0.5,
            "target_mean": float(mean[0]),
            "target_std": float(scale[0]),
        }
    scores: dict[str, float] = {}
    for j, (squared, centre, spread) in enumerate(zip(error.tolist(), mean, scale, strict=True)):
        scores |= {
            f"rmse_unscaled[{j}]": (squared / n) ** 0.5,
            f"target_mean[{j}]": float(centre),
            f"target_std[{j}]": float(spread),
        }
    return scores


class Classification(Objective):
    """Integer class labels: cross-entropy of the model's class logits, summed over samples;
    scored by accuracy and log-loss (the mean cross-entropy)."""

    name = "classification"

    def loss_sum(self, prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(prediction, target.reshape(-1), reduction="sum")

    def metric_sums(self, prediction: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        labels = target.reshape(-1)
        return {
            "correct": (prediction.argmax(dim=1) == labels).sum().double(),
            "log_loss": F.cross_entropy(prediction.double(), labels, reduction="sum"),
        }

    def metrics(self, sums: dict[str, torch.Tensor], n: int) -> dict[str, float]:
        return {"accuracy": float(sums["correct"]) / n, "log_loss": float(sums["log_loss"]) / n}


OBJECTIVES: dict[str, Objective] = {o.name: o for o in (Regression(), Classification())}


class TaskConfig(NumbersNotBooleans):
    # no infinite or NaN floats (YAML's .inf, .nan): no option of a task means them (and no
    # boolean for a number: the base class)
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str

    @property
    def label(self) -> str:
        """The task as tables name it (its name; the dataset, file or equation where there is one)."""
        return self.name

    @property
    def preparation(self) -> dict | None:
        """What was done to the task's given table before training (rows dropped, columns
        encoded), for the run record; None where nothing was."""
        return None

    @property
    def goal(self) -> Objective:
        """Regression or classification: the loss and metrics below come from it."""
        raise NotImplementedError

    @property
    def input_dim(self) -> int:
        raise NotImplementedError

    @property
    def output_dim(self) -> int:
        raise NotImplementedError

    if TYPE_CHECKING:
        # Fields of a synthetic task, properties of one whose data is given: declared here for the
        # type checker only, since a pydantic base that declared them would make them fields of
        # every task.
        @property
        def n_train(self) -> int: ...

        @property
        def n_test(self) -> int: ...

    def generate(self, seed: int) -> TaskData:
        raise NotImplementedError

    def loss_sum(self, prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.goal.loss_sum(prediction, target)

    def metric_sums(self, prediction: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.goal.metric_sums(prediction, target)

    def metrics(self, sums: dict[str, torch.Tensor], n: int) -> dict[str, float]:
        return self.goal.metrics(sums, n)
