"""``task.name: file``: a table the user hands over, as CSV, Parquet (through pandas) or NumPy
(``.npy``, ``.npz``), with which columns are the inputs and which is the target.

    task: {name: file, path: data/houses.csv, target: price, objective: regression}
    task: {name: file, path: cells.parquet, target: label, features: [area, perimeter], objective: classification}
    task: {name: file, path: table.npy, target: -1}          # a 2-D array; the target column by index
    task: {name: file, path: arrays.npz, features: x, target: y}   # two arrays by key
    task: {name: file, path: penguins.csv, target: species, objective: classification,
           missing: drop, categorical: onehot}   # a file as it comes: text columns, empty cells

Every problem is refused when the experiment is validated, before anything is launched, with the
field, the file, the rows and values where there are some, and the fix. A problem of the file's
shape is refused as it is found: a missing file or column, a column named twice or both as the
target and as an input (the model would be fed its answer), an empty file, a CSV or Parquet file
wider than :data:`MAX_COLUMNS`. The problems in its cells (an input or a regression target that
is not a number, a missing value or class label, an infinite value) are refused all in one
message, and two options mend most of them (kan_models/tasks/prepare.py). A file's regression
target is standardised by default (``standardize_target``): trained on as given, palmerpenguins'
body mass in grams ends far below an r2 of 0.

Every check is one operation over the whole table, not one per column: pandas pays for each
column of every sub-frame it builds, so the frame is turned into one NumPy array at once and
checked there. A file of a million columns is still too slow for pandas to read, and takes
gigabytes; hence the limit, and .npy/.npz, which NumPy reads at any width (docs/models.md).
"""

from __future__ import annotations

import csv
import os
import shlex
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, NoReturn

import numpy as np
import pandas as pd
from pydantic import Field, ValidationError, model_validator

from kan_models.tasks.contract import OBJECTIVES, Objective
from kan_models.tasks.data import DataTask, Table, listing
from kan_models.tasks.prepare import ENCODED, Read, Text, as_numbers, prepare, refuse
from kanscale.extras import require

# The widest CSV and Parquet files read. pandas (and pyarrow, for Parquet's metadata) pay for
# every column: at these widths a 3-row file is read and checked in seconds
# (scripts/bench_file_validation.py), and the time grows with the width from there.
MAX_COLUMNS = {".csv": 100_000, ".parquet": 30_000}


def read_csv(path: str) -> pd.DataFrame:
    # low_memory=False types each column from all its rows at once; read in chunks, a wide file
    # takes several times longer and a column may come out with two types
    return pd.read_csv(path, low_memory=False)


TABULAR: dict[str, Callable[[str], pd.DataFrame]] = {".csv": read_csv, ".parquet": pd.read_parquet}
SUFFIXES = (*TABULAR, ".npy", ".npz")
FEATURE_FIX = "convert it to numbers or leave it out of task.features"


PREPARATION_ROWS = 20  # the dropped rows a record names (1-based), the first of them: a record stays small


class FileTask(DataTask):
    name: Literal["file"]
    path: str = Field(
        description=f"the data file ({', '.join(SUFFIXES)}); relative paths are from the working directory"
    )
    target: str | int | list[str] | None = Field(
        None,
        description="the target: a column name, or a list of them for several outputs (CSV, Parquet), a column "
        "index (.npy, default the last), an array key (.npz, default y)",
    )
    features: list[str | int] | str | None = Field(
        None,
        description="the inputs: column names or indices (default: every other column), or an .npz key (default x)",
    )
    objective: Literal["regression", "classification"] = Field(
        "regression", description="regression: real targets (MSE); classification: labels of any type (cross-entropy)"
    )
    missing: Literal["refuse", "drop"] = Field(
        "refuse",
        description="a row with a missing value (NaN, an empty cell) in an input or the target: refuse the "
        "file, or drop the row",
    )
    categorical: Literal["refuse", "onehot", "codes"] = Field(
        "refuse",
        description="an input column of text: refuse it, or encode it as one 0/1 column per category "
        "(onehot) or as one column of category numbers 0..C-1 (codes), categories sorted",
    )
    standardize_target: bool = Field(
        True,
        description="regression: centre and scale the targets by the train split's "
        "mean and std (metrics also in the target's units: *_unscaled)",
    )

    @model_validator(mode="after")
    def _readable(self) -> FileTask:
        self.table()  # every problem with the file, now rather than on the ranks
        return self

    @property
    def label(self) -> str:
        """The file's name, and what was done to its table: tables tell runs on other rows apart."""
        table = self.table()
        done = ([f"{len(table.dropped)} row(s) with missing values dropped"] if len(table.dropped) else []) + (
            [f"{ENCODED[self.categorical]}: {listing(list(table.encoded), most=4)}"] if table.encoded else []
        )
        return f"file {Path(self.path).name}" + (f" ({'; '.join(done)})" if done else "")

    @property
    def preparation(self) -> dict | None:
        table = self.table()
        if not len(table.dropped) and not table.encoded:
            return None
        return {
            "rows_dropped": len(table.dropped),
            "first_rows_dropped": table.dropped[:PREPARATION_ROWS].tolist(),
            "encoding": self.categorical if table.encoded else None,
            "encoded": table.encoded,
        }

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
        return read_table(
            str(path.resolve()),
            stat.st_mtime_ns,
            stat.st_size,
            target,
            features,
            self.objective,
            self.missing,
            self.categorical,
            self.path,
            self.test_fraction,
        )


@lru_cache(maxsize=8)
def read_table(
    path: str,
    mtime: int,
    size: int,
    target: str | int | tuple | None,
    features: tuple | str | None,
    objective: str,
    missing: str,
    categorical: str,
    given: str,
    test_fraction: float,
) -> Table:
    """The table at ``path`` (``mtime`` and ``size`` key the cache, so a changed file is read
    again); ``given`` is the path as the user wrote it, for messages."""
    suffix = Path(path).suffix
    if suffix in TABULAR:
        frame = read_frame(path, suffix, given)
        if target is None and len(frame.columns) > 1:
            refuse_without_target(frame, features, objective, missing, categorical, given, test_fraction)
        read = from_frame(frame, target, features, given)
    else:
        read = from_arrays(path, suffix, target, features, given)
    if len(read.x) < 2:
        raise ValueError(f"task.path: {given} holds {len(read.x)} sample(s); a train and a test split need at least 2")
    return prepare(read, objective, missing, categorical, given, test_fraction)


def refuse_without_target(
    frame: pd.DataFrame,
    features: tuple | str | None,
    objective: str,
    missing: str,
    categorical: str,
    given: str,
    test_fraction: float,
) -> NoReturn:
    """A table without ``task.target``: refused naming its columns, with every problem its cells
    would meet were the last column the target (the usual place), so that one refusal says all."""
    assumed = str(frame.columns[-1])
    found = [
        (
            "task.target",
            f"name the target column of {given} (its columns: {listing(frame.columns.astype(str))}); "
            f"the last one: --set {shlex.quote(f'task.target={assumed}')}",
        )
    ]
    try:
        prepare(from_frame(frame, assumed, features, given), objective, missing, categorical, given, test_fraction)
    except ValidationError as err:
        found += [
            (".".join(["task", *map(str, e["loc"])]), f"{e['msg']} (with target {assumed!r})") for e in err.errors()
        ]
    except ValueError:
        pass  # what the named target meets is said once it is named
    refuse(found, given)


def read_frame(path: str, suffix: str, given: str) -> pd.DataFrame:
    if suffix == ".parquet":
        require("parquet", f"task.path: reading {given}")
    try:
        width = column_count(path, suffix)
        frame = TABULAR[suffix](path) if width <= MAX_COLUMNS[suffix] else None
    except pd.errors.EmptyDataError:
        raise ValueError(f"task.path: {given} is empty") from None
    except (UnicodeDecodeError, pd.errors.ParserError, csv.Error, OSError, ValueError) as err:
        raise ValueError(f"task.path: {given} cannot be read as {suffix[1:]}: {str(err).splitlines()[0]}") from None
    if frame is None:
        raise ValueError(
            f"task.path: {given} has {width:,} columns, more than the {MAX_COLUMNS[suffix]:,} kanscale reads "
            f"from a {suffix[1:]} file (it is read column by column: a million columns take 15 s or more "
            "and 2 GB); save the table as .npy (numpy.save) or .npz, which are read at any width"
        )
    if frame.empty:
        raise ValueError(
            f"task.path: {given} has no rows" + (f" (columns: {listing(frame.columns)})" if len(frame.columns) else "")
        )
    return frame


def column_count(path: str, suffix: str) -> int:
    """How many columns the file has, from its first line or its Parquet metadata alone: reading
    a table too wide for pandas is what the count is there to prevent."""
    if suffix == ".csv":
        with open(path, newline="", encoding="utf-8", errors="replace") as file:
            return len(next(csv.reader(file), []))
    import pyarrow.parquet

    return pyarrow.parquet.read_metadata(path).num_columns


def from_frame(frame: pd.DataFrame, target: str | int | tuple | None, features: tuple | str | None, given: str) -> Read:
    """The inputs as numbers and the target as given (:class:`Read`). The frame is the one read
    for this: its columns that are not numbers are replaced in place."""
    # object, not pandas' Arrow strings: their isin against a long list is far slower
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
            raise ValueError(
                f"{field}: no column {listing([repr(n) for n in absent])} in {given}; its columns: {listing(names)}"
            )
    if not names.is_unique:  # 1 and "1" in a Parquet file: both read as "1"
        raise ValueError(
            f"task.path: {given} has more than one column named "
            f"{listing([repr(n) for n in names[names.duplicated()].unique()])}; rename them apart"
        )
    check_choice(targets, chosen, given, lambda name: f"column {name!r}")
    x_at, y_at = names.get_indexer(chosen), names.get_indexer(targets)
    y = frame.iloc[:, y_at].to_numpy()  # as given: labels stay labels
    text = np.flatnonzero(~frame.dtypes.map(pd.api.types.is_numeric_dtype).to_numpy(dtype=bool))
    is_input = np.isin(text, x_at)
    inputs = text[is_input]
    # the text inputs as numbers where they are, the rest NaN, so that the frame becomes one float array
    block, found = as_numbers(frame.iloc[:, inputs].to_numpy(dtype=object), "task.features", given, FEATURE_FIX)
    if len(text):
        filler = np.full((len(frame), len(text)), np.nan)
        filler[:, is_input] = block
        frame.isetitem(text.tolist(), filler)
    x = frame.to_numpy(dtype=np.float64, na_value=np.nan)[:, x_at]
    # the block's text columns, by their position among the inputs
    at = pd.Index(x_at).get_indexer(inputs[found.at])
    order = np.argsort(at)
    found = Text(at[order], found.cells[:, order], found.bad[:, order])
    return Read(
        x,
        found,
        lambda i: f"column {chosen[i]!r}",
        lambda i: str(chosen[i]),
        y[:, 0] if len(targets) == 1 else y,
        lambda j: f"column {targets[j]!r}",
    )


def from_arrays(
    path: str, suffix: str, target: str | int | tuple | None, features: tuple | str | None, given: str
) -> Read:
    try:
        loaded = np.load(path, allow_pickle=False)  # never unpickle what a user hands over
    except (ValueError, OSError, EOFError) as err:
        raise ValueError(f"task.path: {given} cannot be read as {suffix[1:]}: {err}") from None
    if suffix == ".npz":
        x_key, y_key = ("x" if features is None else features), ("y" if target is None else target)
        for field, key, what in (
            ("task.features", x_key, "inputs are one array (default x)"),
            ("task.target", y_key, "target is one array (default y)"),
        ):
            if not isinstance(key, str):
                raise ValueError(
                    f"{field}: an .npz file's {what}; give its key, not "
                    f"{list(key) if isinstance(key, tuple) else key!r}"
                )
            if key not in loaded.files:
                raise ValueError(f"{field}: no array {key!r} in {given}; its arrays: {', '.join(loaded.files)}")
        if x_key == y_key:
            raise ValueError(
                f"task.features: {x_key!r} of {given} is task.target too: the model would be fed its "
                "answer; give the inputs' array as task.features"
            )
        x, y = loaded[x_key], loaded[y_key]
        if x.ndim == 1:
            x = x.reshape(-1, 1)
        if x.ndim != 2 or len(x) != len(y):
            raise ValueError(
                f"task.features: {given}'s {x_key!r} must be (samples, inputs) with as many rows as "
                f"{y_key!r}; got {x.shape} and {y.shape}"
            )
        x_name = lambda i: f"{x_key}[:, {i}]"  # noqa: E731
        return Read(
            *as_numbers(x, "task.features", given, FEATURE_FIX),
            x_name,
            x_name,
            y,
            lambda j: f"array {y_key!r}" if y.ndim == 1 else f"{y_key}[:, {j}]",
        )
    if loaded.ndim != 2 or loaded.shape[1] < 2:
        raise ValueError(
            f"task.path: {given} must hold a 2-D array (samples, columns) of at least 2 columns, got {loaded.shape}"
        )
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
            raise ValueError(
                f"task.features: give column indices of {given}'s {width} columns, "
                f"got {listing([repr(p) for p in picked])}"
            )
        chosen %= width
    check_choice(pd.Index([column]), pd.Index(chosen), given, lambda i: f"column {i}")
    return Read(
        *as_numbers(loaded[:, chosen], "task.features", given, FEATURE_FIX),
        lambda i: f"column {chosen[i]}",
        lambda i: str(chosen[i]),
        loaded[:, column],
        lambda j: f"column {column}",
    )


def check_choice(targets: pd.Index, chosen: pd.Index, given: str, name: Callable[[Any], str]) -> None:
    """Refuse a column named twice, and one that is the target and an input at once: the model
    would be fed its answer and score perfectly on a task it never learned."""
    for field, picked in (("task.target", targets), ("task.features", chosen)):
        twice = picked[picked.duplicated()].unique()
        if len(twice):
            raise ValueError(
                f"{field}: {listing([name(n) for n in twice])} of {given} is named more than once; "
                "name each column once"
            )
    both = chosen.intersection(targets)
    if len(both):
        raise ValueError(
            f"task.features: {listing([name(n) for n in both])} of {given} is task.target too: the model "
            "would be fed its answer; leave the target out of task.features"
        )
    if not len(chosen):
        raise ValueError(
            f"task.features: no input column of {given} is left besides the target "
            f"{listing([name(n) for n in targets])}; name the inputs in task.features"
        )
