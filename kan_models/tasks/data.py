"""Tasks whose data is given rather than drawn: a table the user hands over (``file``) or a
dataset that ships inside an installed package (``sklearn``). Nothing is downloaded.

The samples are split into train and test by ``test_fraction`` with the experiment's seed, and
with ``standardize`` every input column is centred and scaled by the mean and standard deviation
of the *train* split only (the test split is never looked at to fit anything);
``standardize_target`` does the same to regression targets, and the test metrics then come in
the target's own units as well (``mse_unscaled``, ``rmse_unscaled``, beside the train split's
``target_mean`` and ``target_std`` they were scaled by). Class labels, of any type, are numbered
0..C-1 in sorted order; a missing label is refused, never made a class. The data is read once
per process and cached; the experiment's validation reads it first, so a bad file is refused
before anything is launched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
from pydantic import Field, PrivateAttr

from kan_models.tasks.contract import OBJECTIVES, Objective, TaskConfig, TaskData, unscaled_metrics


@dataclass(frozen=True)
class Table:
    """A task's samples: inputs (n, d) as float64, targets (n,) or (n, k), and for a
    classification the number of classes; for a file, the rows dropped for a missing value
    (1-based) and the text columns encoded, with their categories."""

    x: np.ndarray
    y: np.ndarray
    classes: int | None = None
    dropped: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    encoded: dict[str, list[str]] = field(default_factory=dict)


def listing(items: Sequence[Any] | np.ndarray | pd.Index, most: int = 8) -> str:
    """Up to ``most`` of ``items``, comma-separated, and how many there are when there are more:
    a message about a file of a million columns stays one readable line."""
    shown = ", ".join(map(str, items[:most]))
    return f"{shown}, ... ({len(items):,} in all)" if len(items) > most else shown


def test_rows(n: int, fraction: float) -> int:
    """The rows of ``n`` held out for testing: ``fraction`` of them, at least one, and one fewer
    than all (the other split needs one too)."""
    return max(1, min(n - 1, round(n * fraction)))


def missing_cells(values: np.ndarray) -> np.ndarray:
    """Which of the cells of a 1-D array are missing: NaN, None, an empty or blank string."""
    # as text, every kind of missing reads alike: NaN and None are <NA>, a blank cell is ""
    return pd.Series(values).astype("string").str.strip().fillna("").eq("").to_numpy(dtype=bool)


def missing_labels_problem(missing: np.ndarray, what: str) -> str:
    rows = np.flatnonzero(missing) + 1
    return (
        f"{what} has {len(rows)} missing label(s) (an empty cell or NaN) in row(s) {listing(rows)}; "
        "a missing label is not a class: fill in those labels or drop those rows"
    )


def as_classes(labels: np.ndarray, what: str) -> tuple[np.ndarray, int]:
    """Labels of any type -> 0..C-1 (sorted order), and C. A missing label (NaN, None, an empty
    or blank string) is refused with its rows: numbered, it would become a class of its own."""
    if labels.ndim != 1:
        raise ValueError(f"{what} is not one column of labels (shape {labels.shape}); a classification has one target")
    missing = missing_cells(labels)
    if missing.any():
        raise ValueError(missing_labels_problem(missing, what))
    names, codes = np.unique(labels, return_inverse=True)
    if len(names) < 2:
        raise ValueError(f"{what} has {len(names)} class(es); a classification needs at least 2")
    return codes.astype(np.int64), len(names)


class DataTask(TaskConfig):
    """A task over a given table (:meth:`table`), split and standardised as the module says."""

    test_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="share of the samples held out for testing")
    standardize: bool = Field(True, description="centre and scale each input by the train split's mean and std")
    standardize_target: bool = Field(
        False,
        description="regression: centre and scale the targets the same way (the "
        "loss and mse, rmse are then in units of the train std; "
        "mse_unscaled, rmse_unscaled in the target's)",
    )
    # The train split's target mean and std of the last generate(), which the test metrics are
    # scaled back by: the trainer asks generate(seed) for the data and metrics(sums, n) for the
    # scores, and only the first knows the seed that decides the split.
    _target_scaling: tuple[np.ndarray, np.ndarray] | None = PrivateAttr(None)

    def table(self) -> Table:
        raise NotImplementedError

    @property
    def goal(self) -> Objective:
        return OBJECTIVES["classification" if self.table().classes else "regression"]

    @property
    def input_dim(self) -> int:
        return self.table().x.shape[1]

    @property
    def output_dim(self) -> int:
        table = self.table()
        return table.classes or (table.y.shape[1] if table.y.ndim == 2 else 1)

    @property
    def n_test(self) -> int:
        return test_rows(len(self.table().x), self.test_fraction)

    @property
    def n_train(self) -> int:
        return len(self.table().x) - self.n_test

    def generate(self, seed: int) -> TaskData:
        table = self.table()
        order = np.random.default_rng(seed).permutation(len(table.x))
        train, test = order[: self.n_train], order[self.n_train :]
        x = table.x
        if self.standardize:
            mean, std = x[train].mean(axis=0), x[train].std(axis=0)
            x = (x - mean) / np.where(std > 0, std, 1.0)  # a constant column stays 0, not NaN
        y = table.y if table.classes else (table.y.reshape(-1, 1) if table.y.ndim == 1 else table.y).astype(np.float64)
        self._target_scaling = None
        if self.standardize_target and not table.classes:
            mean, std = y[train].mean(axis=0), y[train].std(axis=0)
            scale = np.where(std > 0, std, 1.0)  # a constant target stays 0, not NaN
            y = (y - mean) / scale
            self._target_scaling = (mean, scale)
        return TaskData(*(torch.from_numpy(np.ascontiguousarray(a)) for a in (x[train], y[train], x[test], y[test])))

    def metrics(self, sums: dict[str, torch.Tensor], n: int) -> dict[str, float]:
        scores = self.goal.metrics(sums, n)
        if self._target_scaling is None:
            return scores
        return scores | unscaled_metrics(sums, n, *self._target_scaling)  # set for a regression only
