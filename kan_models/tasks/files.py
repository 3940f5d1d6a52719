"""``task.name: file``: a table the user hands over, as CSV, Parquet (through pandas) or NumPy
(``.npy``, ``.npz``), with which columns are the inputs and which is the target.

    task: {name: file, path: data/houses.csv, target: price, objective: regression}
    task: {name: file, path: cells.parquet, target: label, features: [area, perimeter], objective: classification}
    task: {name: file, path: table.npy, target: -1}          # a 2-D array; the target column by index
    task: {name: file, path: arrays.npz, features: x, target: y}   # two arrays by key

Every problem is refused when the experiment is validated, before anything is launched, with the
field, the file, the rows and values where there are some, and the fix: a missing file or column,
a column named twice or both as the target and as an input (the model would be fed its answer),
an input or a regression target that is not a number, a missing value (NaN) or class label, an
empty file, and a CSV or Parquet file wider than :data:`MAX_COLUMNS`.

Every check is one operation over the whole table, not one per column: pandas pays some
10-20 us for each column of every sub-frame it builds, so the frame is turned into one NumPy
array at once and checked there. A file of a million columns is still too slow for pandas to
read (a 3-row CSV: 15-50 s and 2-3 GB here); hence the limit, and .npy/.npz, which NumPy reads
at any width (a million columns in 0.1 s).
"""

from __future__ import annotations

import csv
import os
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np
import pandas as pd
from pydantic import Field, model_validator

from kan_models.tasks.contract import OBJECTIVES, Objective
from kan_models.tasks.data import DataTask, Table, as_classes, listing

# The widest CSV and Parquet files read. pandas (and pyarrow, for Parquet's metadata) pay for
# every column: at these widths a 3-row file is read and checked in ~4 s on a loaded 2-core VM
# (scripts/bench_file_validation.py), and the time grows with the width from there.
MAX_COLUMNS = {".csv": 100_000, ".parquet": 30_000}


def read_csv(path: str) -> pd.DataFrame:
    # low_memory=False types each column from all its rows at once; read in chunks, a wide file
    # takes several times longer and a column may come out with two types
    return pd.read_csv(path, low_memory=False)


TABULAR = {".csv": read_csv, ".parquet": pd.read_parquet}
SUFFIXES = (*TABULAR, ".npy", ".npz")
FEATURE_FIX = "convert it to numbers or leave it out of task.features"
TARGET_FIX = "a regression target is a number; if these are class labels, set task.objective: classification"
Label = Callable[[int], str]  # a column's position -> how a message names it


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
        x, x_label, y, y_label = from_frame(read_frame(path, suffix, given), target, features, given)
    else:
        x, x_label, y, y_label = from_arrays(path, suffix, target, features, given)
    if len(x) < 2:
        raise ValueError(f"task.path: {given} holds {len(x)} sample(s); a train and a test split need at least 2")
    check_finite(x, x_label, given, "task.features")
    if objective == "classification":
        labels, classes = as_classes(y, f"task.target: {y_label(0)} of {given}")
        return Table(x, labels, classes)
    values = numbers(y.reshape(len(y), -1), y_label, given, "task.target", TARGET_FIX)
    check_finite(values, y_label, given, "task.target")
    return Table(x, values.reshape(y.shape))


def read_frame(path: str, suffix: str, given: str) -> pd.DataFrame:
    try:
        width = column_count(path, suffix)
        frame = TABULAR[suffix](path) if width <= MAX_COLUMNS[suffix] else None
    except pd.errors.EmptyDataError:
        raise ValueError(f"task.path: {given} is empty") from None
    except ImportError as err:  # Parquet without its engine
        raise ValueError(f"task.path: reading {given} needs pyarrow ({err}); pip install pyarrow") from None
    except (UnicodeDecodeError, pd.errors.ParserError, csv.Error, OSError, ValueError) as err:
        raise ValueError(f"task.path: {given} cannot be read as {suffix[1:]}: {str(err).splitlines()[0]}") from None
    if frame is None:
        raise ValueError(f"task.path: {given} has {width:,} columns, more than the {MAX_COLUMNS[suffix]:,} kanscale reads "
                         f"from a {suffix[1:]} file (it is read column by column: a million columns take 15 s or more "
                         "and 2 GB); save the table as .npy (numpy.save) or .npz, which are read at any width")
    if frame.empty:
        raise ValueError(f"task.path: {given} has no rows" + (f" (columns: {listing(frame.columns)})"
                                                               if len(frame.columns) else ""))
    return frame


def column_count(path: str, suffix: str) -> int:
    """How many columns the file has, from its first line or its Parquet metadata alone: reading
    a table too wide for pandas is what the count is there to prevent."""
    if suffix == ".csv":
        with open(path, newline="", encoding="utf-8", errors="replace") as file:
            return len(next(csv.reader(file), []))
    import pyarrow.parquet

    return pyarrow.parquet.read_metadata(path).num_columns


def from_frame(frame: pd.DataFrame, target: str | int | tuple | None, features: tuple | str | None,
               given: str) -> tuple[np.ndarray, Label, np.ndarray, Label]:
    """The inputs as numbers and the target as given, with how messages name their columns. The
    frame is the one read for this: its columns that are not numbers are replaced in place."""
    # object, not pandas' Arrow strings: their isin against a long list is ~50x slower
    names = pd.Index(frame.columns.astype(str), dtype=object)
    if target is None:
        raise ValueError(f"task.target: name the target column of {given} (its columns: {listing(names)})")
    targets = pd.Index([str(t) for t in target] if isinstance(target, tuple) else [str(target)], dtype=object)
    if features is None:
        chosen = names[~names.isin(targets)]
    else:
        chosen = pd.Index([str(f) for f in features] if isinstance(features, tuple) else [str(features)], dtype=object)
    for field, picked in (("task.target", targets), ("task.features", chosen)):
        absent = picked[~picked.isin(names)]
        if len(absent):
            raise ValueError(f"{field}: no column {listing([repr(n) for n in absent])} in {given}; its columns: "
                             f"{listing(names)}")
    if not names.is_unique:  # 1 and "1" in a Parquet file: both read as "1"
        raise ValueError(f"task.path: {given} has more than one column named "
                         f"{listing([repr(n) for n in names[names.duplicated()].unique()])}; rename them apart")
    check_choice(targets, chosen, given, lambda name: f"column {name!r}")
    x_at, y_at = names.get_indexer(chosen), names.get_indexer(targets)
    y = frame.iloc[:, y_at].to_numpy()  # as given: labels stay labels
    text = np.flatnonzero(~frame.dtypes.map(pd.api.types.is_numeric_dtype).to_numpy(dtype=bool))
    if len(text):  # as numbers (inputs) or NaN (the rest), so that the frame becomes one float array
        filler = np.full((len(frame), len(text)), np.nan)
        inputs = np.isin(text, x_at)
        filler[:, inputs] = numbers(frame.iloc[:, text[inputs]].to_numpy(dtype=object),
                                    lambda i: f"column {names[text[inputs][i]]!r}", given, "task.features", FEATURE_FIX)
        frame.isetitem(text.tolist(), filler)
    x = frame.to_numpy(dtype=np.float64, na_value=np.nan)[:, x_at]
    return x, lambda i: f"column {chosen[i]!r}", y[:, 0] if len(targets) == 1 else y, lambda j: f"column {targets[j]!r}"


def from_arrays(path: str, suffix: str, target: str | int | tuple | None, features: tuple | str | None,
                given: str) -> tuple[np.ndarray, Label, np.ndarray, Label]:
    try:
        loaded = np.load(path, allow_pickle=False)  # never unpickle what a user hands over
    except (ValueError, OSError, EOFError) as err:
        raise ValueError(f"task.path: {given} cannot be read as {suffix[1:]}: {err}") from None
    if suffix == ".npz":
        x_key, y_key = ("x" if features is None else features), ("y" if target is None else target)
        for field, key, what in (("task.features", x_key, "inputs are one array (default x)"),
                                 ("task.target", y_key, "target is one array (default y)")):
            if not isinstance(key, str):
                raise ValueError(f"{field}: an .npz file's {what}; give its key, not "
                                 f"{list(key) if isinstance(key, tuple) else key!r}")
            if key not in loaded.files:
                raise ValueError(f"{field}: no array {key!r} in {given}; its arrays: {', '.join(loaded.files)}")
        if x_key == y_key:
            raise ValueError(f"task.features: {x_key!r} of {given} is task.target too: the model would be fed its "
                             "answer; give the inputs' array as task.features")
        x, y = loaded[x_key], loaded[y_key]
        if x.ndim == 1:
            x = x.reshape(-1, 1)
        if x.ndim != 2 or len(x) != len(y):
            raise ValueError(f"task.features: {given}'s {x_key!r} must be (samples, inputs) with as many rows as "
                             f"{y_key!r}; got {x.shape} and {y.shape}")
        x_label = lambda i: f"{x_key}[:, {i}]"  # noqa: E731
        return (numbers(x, x_label, given, "task.features", FEATURE_FIX), x_label, y,
                lambda j: f"array {y_key!r}" if y.ndim == 1 else f"{y_key}[:, {j}]")
    if loaded.ndim != 2 or loaded.shape[1] < 2:
        raise ValueError(f"task.path: {given} must hold a 2-D array (samples, columns) of at least 2 columns, got {loaded.shape}")
    width = loaded.shape[1]
    column = -1 if target is None else target
    if not isinstance(column, int) or not -width <= column < width:
        raise ValueError(f"task.target: {target!r} is not a column index of {given}'s {width} columns")
    column %= width
    if features is None:
        chosen = np.delete(np.arange(width), column)
    else:
        picked = list(features) if isinstance(features, tuple) else [features]
        chosen = np.array(picked) if picked else np.zeros(0, dtype=np.int64)
        if chosen.dtype.kind != "i" or not ((-width <= chosen) & (chosen < width)).all():
            raise ValueError(f"task.features: give column indices of {given}'s {width} columns, got {listing([repr(p) for p in picked])}")
        chosen %= width
    check_choice(pd.Index([column]), pd.Index(chosen), given, lambda i: f"column {i}")
    x_label = lambda i: f"column {chosen[i]}"  # noqa: E731
    return (numbers(loaded[:, chosen], x_label, given, "task.features", FEATURE_FIX), x_label, loaded[:, column],
            lambda j: f"column {column}")


def check_choice(targets: pd.Index, chosen: pd.Index, given: str, name: Callable[[Any], str]) -> None:
    """Refuse a column named twice, and one that is the target and an input at once: the model
    would be fed its answer and score perfectly on a task it never learned."""
    for field, picked in (("task.target", targets), ("task.features", chosen)):
        twice = picked[picked.duplicated()].unique()
        if len(twice):
            raise ValueError(f"{field}: {listing([name(n) for n in twice])} of {given} is named more than once; "
                             "name each column once")
    both = chosen.intersection(targets)
    if len(both):
        raise ValueError(f"task.features: {listing([name(n) for n in both])} of {given} is task.target too: the model "
                         "would be fed its answer; leave the target out of task.features")
    if not len(chosen):
        raise ValueError(f"task.features: no input column of {given} is left besides the target "
                         f"{listing([name(n) for n in targets])}; name the inputs in task.features")


def numbers(values: np.ndarray, label: Label, given: str, field: str, fix: str) -> np.ndarray:
    """``values`` (n, d) of any dtype as float64, refusing a column that holds anything but
    numbers with its first such row and value; missing values stay NaN (:func:`check_finite`)."""
    if values.dtype.kind in "biuf":
        return values.astype(np.float64, copy=False)
    if values.dtype.kind not in "OUS":  # complex numbers, dates: no one number to take
        raise ValueError(f"{field}: {given} holds {values.dtype} data where numbers are needed; {fix}")
    cells = values.ravel(order="F").astype(object)  # column after column: the first bad cell is in the first bad column
    coerced = pd.to_numeric(pd.Series(cells), errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
    bad = np.flatnonzero(np.isnan(coerced) & ~pd.isna(cells))
    if len(bad):
        column, row = divmod(int(bad[0]), len(values))
        more = np.count_nonzero(bad < (column + 1) * len(values)) - 1
        raise ValueError(f"{field}: {label(column)} of {given} is not numeric (row {row + 1}: {cells[bad[0]]!r}"
                         + (f", and {more} more row(s)" if more else "") + f"); {fix}")
    return coerced.reshape(values.shape, order="F")


def check_finite(values: np.ndarray, label: Label, given: str, field: str) -> None:
    """Refuse missing (NaN) and infinite values, naming the first column that has them, how many
    and in which rows."""
    if np.isfinite(values).all():
        return
    for bad, what, fix in ((np.isnan(values), "missing value(s) (NaN)", "fill or drop them before training"),
                           (np.isinf(values), "infinite value(s)", "replace them before training")):
        columns = np.flatnonzero(bad.any(axis=0))
        if len(columns):
            rows = np.flatnonzero(bad[:, columns[0]]) + 1
            raise ValueError(f"{field}: {label(int(columns[0]))} of {given} has {len(rows)} {what}, the first in row "
                             f"{rows[0]}" + (f" (rows {listing(rows)})" if len(rows) > 1 else "") + f"; {fix}")
