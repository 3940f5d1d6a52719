"""What a file's inputs and target need before a model trains on them: every problem found in
one pass and refused together, or mended by the file task's two options.

- ``missing: drop`` drops every row with a missing value (NaN, an empty or blank cell) in an
  input or in the target; the rows dropped are kept in :class:`Table` and named in the task's
  label.
- ``categorical: onehot`` turns each input column that holds text into one 0/1 column per
  category, ``categorical: codes`` into one column of its category's number 0..C-1; the
  categories are the column's distinct values as text, in sorted order, over the rows kept.

A problem neither option mends (a regression target that is not a number, an infinite value) is
refused beside the others. The message has one line per column and problem, at most
:data:`PER_KIND` of each kind and then one line listing the rest, each with its fix; a file that
needs both options says so in a last line. A user learns in one run what used to take one run
per problem.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import numpy as np
import pandas as pd
from pydantic_core import InitErrorDetails, PydanticCustomError, ValidationError

from kan_models.tasks.data import Table, as_classes, listing, missing_cells, missing_labels_problem, test_rows

PER_KIND = 4  # lines per kind of problem before the rest are listed in one: the message stays a screen
CATEGORICAL_FIX = "encode it with --set task.categorical=onehot (or =codes), or leave it out of task.features"
MISSING_FIX = "fill or drop them: --set task.missing=drop drops every row with a missing value"
TARGET_FIX = "a regression target is a number; if these are class labels, set task.objective: classification"
ENCODED = {"onehot": "one-hot", "codes": "coded"}  # the option -> how the task's label says it
Label = Callable[[int], str]  # a column's position -> how a message names it
Problem = tuple[str, str]  # (the field, e.g. task.features; what is wrong and the fix)


@dataclass(frozen=True)
class Text:
    """The columns of a block that hold something other than numbers: their positions (in
    ascending order), their cells as read, and which of those cells are not numbers (a missing
    cell is missing, not text)."""

    at: np.ndarray
    cells: np.ndarray
    bad: np.ndarray


@dataclass(frozen=True)
class Read:
    """A file's chosen inputs and target as read: the inputs as numbers (NaN where a cell is
    missing or not a number) with the columns that hold text, the target as given, and how
    messages (``x_label``: "column 'island'") and the label (``x_name``: "island") name them."""

    x: np.ndarray
    text: Text
    x_label: Label
    x_name: Callable[[int], str]
    y: np.ndarray
    y_label: Label


def as_numbers(values: np.ndarray, field: str, given: str, fix: str) -> tuple[np.ndarray, Text]:
    """``values`` (n, d) of any dtype as float64, NaN where a cell is missing or not a number,
    and the columns that hold something that is not a number. One pass over all cells at once."""
    n = len(values)
    if values.dtype.kind in "biuf":
        return values.astype(np.float64, copy=False), Text(
            np.zeros(0, np.int64), np.empty((n, 0), object), np.zeros((n, 0), bool)
        )
    if values.dtype.kind not in "OUS":  # complex numbers, dates: no one number to take
        raise ValueError(f"{field}: {given} holds {values.dtype} data where numbers are needed; {fix}")
    cells = values.astype(object)
    flat = cells.ravel()
    coerced = pd.to_numeric(pd.Series(flat), errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
    bad = (np.isnan(coerced) & ~missing_cells(flat)).reshape(values.shape)  # NaN in coerced too
    coerced = coerced.reshape(values.shape)
    at = np.flatnonzero(bad.any(axis=0))
    return coerced, Text(at, cells[:, at], bad[:, at])


def prepare(read: Read, objective: str, missing: str, categorical: str, given: str, test_fraction: float) -> Table:
    """The table a model trains on, or every problem of the file refused at once (:func:`refuse`)."""
    n = len(read.x)
    x_missing = np.isnan(read.x)
    x_missing[:, read.text.at] &= ~read.text.bad
    problems: list[Problem] = []
    if categorical == "refuse":
        problems += per_column(
            "task.features",
            read.text.at,
            lambda k: not_numeric(read, k, given),
            lambda rest: (
                f"{len(rest)} more column(s) of {given} are not numeric: "
                f"{listing([read.x_label(c) for c in rest])}; {CATEGORICAL_FIX}"
            ),
        )
    if missing == "refuse":
        problems += missing_values("task.features", x_missing, read.x_label, given)
    problems += infinite_values("task.features", read.x, read.x_label, given)
    if objective == "classification":  # several label columns: as_classes refuses them below
        y_missing = missing_cells(read.y) if read.y.ndim == 1 else np.zeros(n, bool)
        if missing == "refuse" and y_missing.any():
            problems.append(
                (
                    "task.target",
                    missing_labels_problem(y_missing, f"{read.y_label(0)} of {given}") + " (--set task.missing=drop)",
                )
            )
        y = read.y
    else:
        y, y_text = as_numbers(read.y.reshape(n, -1), "task.target", given, TARGET_FIX)
        problems += per_column(
            "task.target",
            y_text.at,
            lambda k: not_numeric_target(y_text, k, read.y_label, given),
            lambda rest: f"{listing([read.y_label(c) for c in rest])} of {given} are not numeric too",
        )
        y_missing_cells = np.isnan(y)
        y_missing_cells[:, y_text.at] &= ~y_text.bad
        if missing == "refuse":
            problems += missing_values("task.target", y_missing_cells, read.y_label, given)
        problems += infinite_values("task.target", y, read.y_label, given)
        y_missing = y_missing_cells.any(axis=1)
        y = y.reshape(read.y.shape)
    incomplete = x_missing.any(axis=1) | y_missing
    fixes = ["--set task.categorical=onehot"] if categorical == "refuse" and len(read.text.at) else []
    fixes += ["--set task.missing=drop"] if missing == "refuse" and incomplete.any() else []
    if len(fixes) == 2 and np.count_nonzero(~incomplete) >= 2:
        # what the model and a step must then take, so that following this line meets no second refusal
        kept = ~incomplete
        inputs = encode(read.x[kept], read.text, kept, "onehot", read.x_name)[0].shape[1]
        rows = int(np.count_nonzero(kept))
        train = rows - test_rows(rows, test_fraction)
        problems.append(
            (
                "task",
                f"to train on {given} as it is, set both: {' '.join(fixes)} (which drops "
                f"{np.count_nonzero(incomplete)} of its {n} rows, leaving {rows} rows of {inputs} inputs: "
                f"model.widths then starts with {inputs}, and a step takes at most the {train} of the training split)",
            )
        )
    if problems:
        refuse(problems, given)
    keep = ~incomplete
    if np.count_nonzero(keep) < 2:
        raise ValueError(
            f"task.missing: dropping the rows with a missing value leaves {np.count_nonzero(keep)} of the "
            f"{n} rows of {given}; a train and a test split need at least 2: fill in the missing values"
        )
    x, encoded = encode(read.x[keep], read.text, keep, categorical, read.x_name)
    dropped = np.flatnonzero(incomplete) + 1
    if objective == "classification":
        labels, classes = as_classes(y[keep], f"task.target: {read.y_label(0)} of {given}")
        return Table(x, labels, classes, dropped=dropped, encoded=encoded)
    return Table(x, y[keep], dropped=dropped, encoded=encoded)


def encode(
    x: np.ndarray, text: Text, keep: np.ndarray, how: str, name: Callable[[int], str]
) -> tuple[np.ndarray, dict[str, list[str]]]:
    """``x`` with each text column replaced, where it stood, by its encoding; and each encoded
    column's categories by name. (No text column is left when ``how`` is refuse: it was refused.)"""
    parts, encoded, start = [], {}, 0
    for k, column in enumerate(text.at):
        categories, codes = np.unique(text.cells[keep, k].astype(str), return_inverse=True)
        encoded[name(int(column))] = categories.tolist()
        parts += [
            x[:, start:column],
            np.eye(len(categories))[codes] if how == "onehot" else codes[:, None].astype(np.float64),
        ]
        start = column + 1
    return (np.concatenate([*parts, x[:, start:]], axis=1) if parts else x), encoded


def per_column(
    field: str, columns: np.ndarray, line: Callable[[int], str], rest: Callable[[np.ndarray], str]
) -> list[Problem]:
    """One line for each of ``columns`` (``line`` takes the index into ``columns``); beyond
    PER_KIND + 1 of them, one for each of the first PER_KIND and one listing the rest."""
    shown = len(columns) if len(columns) <= PER_KIND + 1 else PER_KIND
    return [(field, line(k)) for k in range(shown)] + ([(field, rest(columns[shown:]))] if shown < len(columns) else [])


def not_numeric(read: Read, k: int, given: str) -> str:
    """An input column that holds text: its first such row and value, how many more, and the
    values an encoding would make categories of."""
    cells, bad = read.text.cells[:, k], read.text.bad[:, k]
    rows = np.flatnonzero(bad)
    values = pd.unique(cells[~missing_cells(cells)].astype(str))
    return (
        f"{read.x_label(int(read.text.at[k]))} of {given} is not numeric (row {rows[0] + 1}: {cells[rows[0]]!r}"
        + (f", and {len(rows) - 1} more row(s)" if len(rows) > 1 else "")
        + f"); its {len(values)} distinct value(s): {listing(sorted(values), most=5)}; {CATEGORICAL_FIX}"
    )


def not_numeric_target(text: Text, k: int, label: Label, given: str) -> str:
    rows = np.flatnonzero(text.bad[:, k])
    return (
        f"{label(int(text.at[k]))} of {given} is not numeric (row {rows[0] + 1}: {text.cells[rows[0], k]!r}"
        + (f", and {len(rows) - 1} more row(s)" if len(rows) > 1 else "")
        + f"); {TARGET_FIX}"
    )


def missing_values(field: str, absent: np.ndarray, label: Label, given: str) -> list[Problem]:
    return cells_problem(field, absent, label, given, "missing value(s) (NaN)", "have missing values", MISSING_FIX)


def infinite_values(field: str, values: np.ndarray, label: Label, given: str) -> list[Problem]:
    if np.isfinite(values).all() or not np.isinf(values).any():  # the common case in one pass
        return []
    return cells_problem(
        field,
        np.isinf(values),
        label,
        given,
        "infinite value(s)",
        "have infinite values",
        "replace them before training",
    )


def cells_problem(
    field: str, mask: np.ndarray, label: Label, given: str, what: str, plural: str, fix: str
) -> list[Problem]:
    """Each column with cells in ``mask``: how many, the first row and the rows."""
    columns = np.flatnonzero(mask.any(axis=0))

    def line(k: int) -> str:
        rows = np.flatnonzero(mask[:, columns[k]]) + 1
        return (
            f"{label(int(columns[k]))} of {given} has {len(rows)} {what}, the first in row {rows[0]}"
            + (f" (rows {listing(rows)})" if len(rows) > 1 else "")
            + f"; {fix}"
        )

    return per_column(
        field,
        columns,
        line,
        lambda rest: f"{len(rest)} more column(s) of {given} {plural}: {listing([label(int(c)) for c in rest])}; {fix}",
    )


def refuse(problems: list[Problem], given: str) -> NoReturn:
    """Raise every problem at once, each as its own error of its own field: the experiment's
    validation lists them one per line (a single ValueError would be one line, cut short)."""
    raise ValidationError.from_exception_data(
        "file task",
        [
            InitErrorDetails(
                type=PydanticCustomError("file_content", "{problem}", {"problem": message}),
                loc=tuple(field.split(".")[1:]),
                input={"path": given},
            )
            for field, message in problems
        ],
    )
