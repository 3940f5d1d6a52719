"""``task.name: file``: a table the user hands over, as CSV, Parquet (through pandas) or NumPy
(``.npy``, ``.npz``), with which columns are the inputs and which is the target.

    task: {name: file, path: data/houses.csv, target: price, objective: regression}
    task: {name: file, path: cells.parquet, target: label, features: [area, perimeter], objective: classification}
    task: {name: file, path: table.npy, target: -1}          # a 2-D array; the target column by index
    task: {name: file, path: arrays.npz, features: x, target: y}   # two arrays by key

Every problem is refused when the experiment is validated, before anything is launched, with the
field and the fix: a missing file or column, a column that is not numeric, missing values (NaN),
an empty file.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd
from pydantic import Field, model_validator

from kan_models.tasks.contract import OBJECTIVES, Objective
from kan_models.tasks.data import DataTask, Table, as_classes

TABULAR = {".csv": pd.read_csv, ".parquet": pd.read_parquet}
SUFFIXES = (*TABULAR, ".npy", ".npz")


class FileTask(DataTask):
    name: Literal["file"]
    path: str = Field(description=f"the data file ({', '.join(SUFFIXES)}); relative paths are from the working directory")
    target: str | int | list[str] | None = Field(
        None, description="the target: a column name, or a list of them for several outputs (CSV, Parquet), a column "
                          "index (.npy, default the last), an array key (.npz, default y)")
    features: list[str | int] | str | None = Field(
        None, description="the inputs: column names or indices (default: every other column), or an .npz key (default x)")
    objective: Literal["regression", "classification"] = Field(
        "regression", description="regression: real targets (MSE); classification: labels of any type (cross-entropy)")

    @model_validator(mode="after")
    def _readable(self) -> "FileTask":
        self.table()  # every problem with the file, now rather than on the ranks
        return self

    @property
    def label(self) -> str:
        return f"file {Path(self.path).name}"

    @property
    def goal(self) -> Objective:
        return OBJECTIVES[self.objective]

    def table(self) -> Table:
        path = Path(self.path)
        if path.suffix not in SUFFIXES:
            raise ValueError(f"task.path: {self.path} is not a file kanscale reads; give one of {', '.join(SUFFIXES)}")
        try:
            stat = os.stat(path)
        except OSError as err:
            raise ValueError(f"task.path: {self.path}: {err.strerror} (relative paths are from {Path.cwd()})") from None
        features = tuple(self.features) if isinstance(self.features, list) else self.features
        target = tuple(self.target) if isinstance(self.target, list) else self.target
        return read_table(str(path.resolve()), stat.st_mtime_ns, stat.st_size, target, features, self.objective, self.path)


@lru_cache(maxsize=8)
def read_table(path: str, mtime: int, size: int, target: str | int | tuple | None, features: tuple | str | None,
               objective: str, given: str) -> Table:
    """The table at ``path`` (``mtime`` and ``size`` key the cache, so a changed file is read
    again); ``given`` is the path as the user wrote it, for messages."""
    suffix = Path(path).suffix
    if suffix in TABULAR:
        x, y, names = from_frame(read_frame(path, suffix, given), target, features, given)
    else:
        x, y, names = from_arrays(path, suffix, target, features, given)
    if len(x) < 2:
        raise ValueError(f"task.path: {given} holds {len(x)} sample(s); a train and a test split need at least 2")
    check_numeric(x, names, given, "task.features")
    if objective == "classification":
        labels, classes = as_classes(y, f"task.target of {given}")
        return Table(x.astype(np.float64), labels, classes)
    check_numeric(y.reshape(len(y), -1), ["the target"], given, "task.target")
    return Table(x.astype(np.float64), y.astype(np.float64))


def read_frame(path: str, suffix: str, given: str) -> pd.DataFrame:
    try:
        frame = TABULAR[suffix](path)
    except pd.errors.EmptyDataError:
        raise ValueError(f"task.path: {given} is empty") from None
    except ImportError as err:  # Parquet without its engine
        raise ValueError(f"task.path: reading {given} needs pyarrow ({err}); pip install pyarrow") from None
    except (UnicodeDecodeError, pd.errors.ParserError, OSError, ValueError) as err:
        raise ValueError(f"task.path: {given} cannot be read as {suffix[1:]}: {str(err).splitlines()[0]}") from None
    if frame.empty:
        raise ValueError(f"task.path: {given} has no rows" + (f" (columns: {', '.join(map(str, frame.columns))})"
                                                               if len(frame.columns) else ""))
    return frame


def from_frame(frame: pd.DataFrame, target: str | int | tuple | None, features: tuple | str | None,
               given: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    columns = [str(c) for c in frame.columns]
    frame.columns = columns
    if target is None:
        raise ValueError(f"task.target: name the target column of {given} (its columns: {', '.join(columns)})")
    targets = [str(t) for t in target] if isinstance(target, tuple) else [str(target)]
    chosen = [str(f) for f in features] if isinstance(features, tuple) else [c for c in columns if c not in targets]
    for field, names in (("task.target", targets), ("task.features", chosen)):
        missing = [n for n in names if n not in columns]
        if missing:
            raise ValueError(f"{field}: no column {', '.join(map(repr, missing))} in {given}; its columns: {', '.join(columns)}")
    if not chosen:
        raise ValueError(f"task.features: {given} has no column besides the target {', '.join(targets)}")
    numeric = frame[chosen].apply(pd.to_numeric, errors="coerce")
    for name in chosen:
        bad = numeric[name].isna() & frame[name].notna()
        if bad.any():
            row = int(np.flatnonzero(bad.to_numpy())[0])
            raise ValueError(f"task.features: column {name!r} of {given} is not numeric (row {row + 1}: "
                             f"{frame[name].iloc[row]!r}); convert it to numbers or leave it out of task.features")
    y = frame[targets].to_numpy()
    return numeric.to_numpy(dtype=np.float64), y[:, 0] if len(targets) == 1 else y, chosen


def from_arrays(path: str, suffix: str, target: str | int | None, features: tuple | str | None,
                given: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    try:
        loaded = np.load(path, allow_pickle=False)  # never unpickle what a user hands over
    except (ValueError, OSError, EOFError) as err:
        raise ValueError(f"task.path: {given} cannot be read as {suffix[1:]}: {err}") from None
    if suffix == ".npz":
        x_key, y_key = features if isinstance(features, str) else "x", target if isinstance(target, str) else "y"
        for field, key in (("task.features", x_key), ("task.target", y_key)):
            if key not in loaded.files:
                raise ValueError(f"{field}: no array {key!r} in {given}; its arrays: {', '.join(loaded.files)}")
        x, y = loaded[x_key], loaded[y_key]
        if x.ndim == 1:
            x = x.reshape(-1, 1)
        if x.ndim != 2 or len(x) != len(y):
            raise ValueError(f"task.features: {given}'s {x_key!r} must be (samples, inputs) with as many rows as "
                             f"{y_key!r}; got {x.shape} and {y.shape}")
        return x, y, [f"{x_key}[:, {i}]" for i in range(x.shape[1])]
    if loaded.ndim != 2 or loaded.shape[1] < 2:
        raise ValueError(f"task.path: {given} must hold a 2-D array (samples, columns) of at least 2 columns, got {loaded.shape}")
    width = loaded.shape[1]
    column = -1 if target is None else target
    if not isinstance(column, int) or not -width <= column < width:
        raise ValueError(f"task.target: {target!r} is not a column index of {given}'s {width} columns")
    column %= width
    chosen = list(features) if isinstance(features, tuple) else [i for i in range(width) if i != column]
    if any(not isinstance(i, int) or not -width <= i < width for i in chosen):
        raise ValueError(f"task.features: give column indices of {given}'s {width} columns, got {list(chosen)}")
    return loaded[:, chosen], loaded[:, column], [f"column {i}" for i in chosen]


def check_numeric(values: np.ndarray, names: list[str], given: str, field: str) -> None:
    """Refuse non-numbers and missing values (NaN), naming the first column that has them."""
    if not np.issubdtype(values.dtype, np.number):
        raise ValueError(f"{field}: {given} holds {values.dtype} data where numbers are needed")
    missing = np.isnan(values.astype(np.float64))
    if missing.any():
        column = int(np.flatnonzero(missing.any(axis=0))[0])
        row = int(np.flatnonzero(missing[:, column])[0])
        raise ValueError(f"{field}: {names[column] if column < len(names) else 'a column'} of {given} has "
                         f"{int(missing[:, column].sum())} missing value(s) (NaN), the first in row {row + 1}; fill or "
                         "drop them before training")
    if not np.isfinite(values.astype(np.float64)).all():
        raise ValueError(f"{field}: {given} holds infinite values; replace them before training")
