"""A data file as it comes: one validation names every problem of its cells (every column of text,
every column with missing values, with counts and rows), each with its fix; the two options that
mend them (task.missing=drop, task.categorical=onehot|codes) do what they say and are named in
the task's label; a file's regression target is standardised on the train split by default and
its test errors are reported in its own units as well (kan_models/tasks/prepare.py, data.py)."""

import math

import numpy as np
import pandas as pd
import pytest
import torch

from kan_models.tasks.prepare import PER_KIND
from kanscale.errors import ConfigError
from strategies.experiment import parse_experiment

ROWS = 20


def experiment(task: dict, widths: list[int]) -> dict:
    return {
        "name": "problems",
        "model": {"family": "bspline", "widths": widths, "grid": 3},
        "task": {"name": "file", **task},
        "training": {"micro_batch": 4, "steps": 1, "warmup_steps": 0},
        "runtime": {"device": "cpu", "threads": 1},
        "output": {"dir": "runs"},
    }


def problems(task: dict, overrides: list[str] = ()) -> list[str]:
    """The lines of the refusal, each without its '  - '."""
    with pytest.raises(ConfigError) as err:
        parse_experiment(experiment(task, [2, 2, 1]), list(overrides))
    return [line.removeprefix("  - ") for line in str(err.value).splitlines()[1:]]


def survey() -> pd.DataFrame:
    """Two text inputs (one with a missing cell), two numeric inputs with missing cells, a clean one
    and a target with a missing value: the problems of a file as it comes, in one table."""
    rng = np.random.default_rng(0)
    frame = pd.DataFrame(
        {
            "colour": np.array(["red", "green", "blue", "green"])[np.arange(ROWS) % 4],
            "a": rng.normal(size=ROWS),
            "size": np.where(np.arange(ROWS) % 2, "big", "small"),
            "b": rng.normal(size=ROWS),
            "c": rng.normal(size=ROWS),
        }
    )
    frame["y"] = 1000 + 100 * frame["a"] + 50 * (frame["size"] == "big")
    frame.loc[[3, 7], "a"] = np.nan
    frame.loc[7, "b"] = np.nan
    frame.loc[11, "size"] = None
    frame.loc[15, "y"] = np.nan
    return frame


def write(frame: pd.DataFrame, path) -> str:
    frame.to_csv(path, index=False) if str(path).endswith(".csv") else frame.to_parquet(path)
    return str(path)


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_one_validation_names_every_problem_of_the_cells_with_its_fix(tmp_path, suffix):
    path = write(survey(), tmp_path / f"survey{suffix}")
    lines = problems({"path": path, "target": "y"})
    encode = "encode it with --set task.categorical=onehot (or =codes), or leave it out of task.features"
    drop = "fill or drop them: --set task.missing=drop drops every row with a missing value"
    assert lines == [
        f"task.features: column 'colour' of {path} is not numeric (row 1: 'red', and {ROWS - 1} more row(s)); its 3 "
        f"distinct value(s): blue, green, red; {encode}",
        f"task.features: column 'size' of {path} is not numeric (row 1: 'small', and {ROWS - 2} more row(s)); its 2 "
        f"distinct value(s): big, small; {encode}",
        f"task.features: column 'a' of {path} has 2 missing value(s) (NaN), the first in row 4 (rows 4, 8); {drop}",
        f"task.features: column 'size' of {path} has 1 missing value(s) (NaN), the first in row 12; {drop}",
        f"task.features: column 'b' of {path} has 1 missing value(s) (NaN), the first in row 8; {drop}",
        f"task.target: column 'y' of {path} has 1 missing value(s) (NaN), the first in row 16; {drop}",
        f"task: to train on {path} as it is, set both: --set task.categorical=onehot --set task.missing=drop "
        f"(which drops 4 of its {ROWS} rows, leaving {ROWS - 4} rows of 8 inputs: model.widths then starts "
        "with 8, and a step takes at most the 13 of the training split)",
    ]


def test_each_option_leaves_the_problems_only_the_other_mends(tmp_path):
    path = write(survey(), tmp_path / "survey.csv")
    encoded = problems({"path": path, "target": "y"}, ["task.categorical=onehot"])
    assert len(encoded) == 4 and all("missing value(s)" in line for line in encoded), encoded
    dropped = problems({"path": path, "target": "y"}, ["task.missing=drop"])
    assert len(dropped) == 2 and all("is not numeric" in line for line in dropped), dropped
    # the other fixes the lines name: leave the text out, fill the holes in
    clean = survey().drop(columns=["colour", "size"]).fillna(0.0)
    cfg = parse_experiment(experiment({"path": write(clean, tmp_path / "filled.csv"), "target": "y"}, [3, 2, 1]))
    assert cfg.task.n_train + cfg.task.n_test == ROWS


def test_both_options_drop_the_rows_and_encode_the_text_where_it_stood(tmp_path):
    path = write(survey(), tmp_path / "survey.csv")
    task = {"path": path, "target": "y"}
    sets = ["task.missing=drop", "task.categorical=onehot"]
    onehot = parse_experiment(experiment({**task, "standardize": False}, [8, 2, 1]), sets).task
    table = onehot.table()
    assert table.dropped.tolist() == [4, 8, 12, 16] and len(table.x) == ROWS - 4
    assert table.encoded == {"colour": ["blue", "green", "red"], "size": ["big", "small"]}
    kept = survey().drop(index=[3, 7, 11, 15]).reset_index(drop=True)
    colour = pd.get_dummies(kept["colour"]).to_numpy(dtype=float)  # columns in sorted order, as the task's
    size = pd.get_dummies(kept["size"]).to_numpy(dtype=float)
    expected = np.column_stack([colour, kept["a"], size, kept["b"], kept["c"]])
    assert np.array_equal(table.x, expected) and np.array_equal(table.y, kept["y"].to_numpy())
    assert onehot.label == "file survey.csv (4 row(s) with missing values dropped; one-hot: colour, size)"
    codes = parse_experiment(
        experiment({**task, "standardize": False}, [5, 2, 1]), ["task.missing=drop", "task.categorical=codes"]
    ).task
    assert codes.input_dim == 5 and codes.label.endswith("; coded: colour, size)")
    assert np.array_equal(codes.table().x[:, 0], kept["colour"].map({"blue": 0, "green": 1, "red": 2}).to_numpy())


def test_missing_class_labels_are_dropped_as_their_message_says(tmp_path):
    frame = survey().drop(columns=["colour", "size"]).fillna({"a": 0.0, "b": 0.0})
    frame["kind"] = np.where(frame["c"] > 0, "up", "down").astype(object)
    frame.loc[[2, 9], "kind"] = None
    path = write(frame.drop(columns="y"), tmp_path / "labels.csv")
    task = {"path": path, "target": "kind", "objective": "classification"}
    (line,) = problems(task)
    assert line.endswith(
        "in row(s) 3, 10; a missing label is not a class: fill in those labels or drop those rows "
        "(--set task.missing=drop)"
    ), line
    cfg = parse_experiment(experiment(task, [3, 2, 2]), ["task.missing=drop"])
    assert cfg.task.table().dropped.tolist() == [3, 10] and sorted(set(cfg.task.table().y)) == [0, 1]


def test_what_no_option_mends_is_named_beside_the_rest_and_stays_refused(tmp_path):
    frame = survey()
    frame.loc[5, "c"] = np.inf
    frame["y"] = frame["y"].astype(object)
    frame.loc[2, "y"] = "heavy"
    path = write(frame, tmp_path / "worse.csv")
    lines = problems({"path": path, "target": "y"}, ["task.missing=drop", "task.categorical=onehot"])
    assert lines == [
        f"task.features: column 'c' of {path} has 1 infinite value(s), the first in row 6; "
        "replace them before training",
        f"task.target: column 'y' of {path} is not numeric (row 3: 'heavy'); a regression target is a number; if these "
        "are class labels, set task.objective: classification",
    ]


def test_a_wide_file_of_problems_lists_the_columns_past_a_screen_in_one_line(tmp_path):
    columns = {f"t{i}": ["x", "y"] * 3 for i in range(12)} | {f"n{i}": [1.0, np.nan] * 3 for i in range(12)}
    path = write(pd.DataFrame(columns | {"y": np.arange(6.0)}), tmp_path / "wide.csv")
    lines = problems({"path": path, "target": "y"})
    assert len(lines) == 2 * (PER_KIND + 1) + 1 <= 20  # the experiment's message shows 20 lines
    assert lines[PER_KIND].startswith(
        f"task.features: {12 - PER_KIND} more column(s) of {path} are not numeric: "
        f"column 't{PER_KIND}', column 't{PER_KIND + 1}'"
    )
    assert lines[2 * PER_KIND + 1].startswith(
        f"task.features: {12 - PER_KIND} more column(s) of {path} have missing values: column 'n{PER_KIND}'"
    )


def test_dropping_every_row_but_one_is_refused(tmp_path):
    path = write(pd.DataFrame({"a": [1.0, np.nan, np.nan], "y": [1.0, 2.0, 3.0]}), tmp_path / "holes.csv")
    (line,) = problems({"path": path, "target": "y"}, ["task.missing=drop"])
    assert line == (
        f"task: task.missing: dropping the rows with a missing value leaves 1 of the 3 rows of {path}; a "
        "train and a test split need at least 2: fill in the missing values"
    )


def test_a_files_target_is_standardised_on_the_train_split_and_scored_in_its_units_too(tmp_path):
    frame = survey().drop(columns=["colour", "size"]).dropna()
    path = write(frame, tmp_path / "grams.csv")
    task = parse_experiment(experiment({"path": path, "target": "y"}, [3, 2, 1])).task
    data = task.generate(seed=1)
    assert data.y_train.mean().abs() < 1e-9 and data.y_train.std(unbiased=False).sub(1).abs() < 1e-9
    prediction = data.y_test + 0.1 * torch.arange(len(data.y_test), dtype=torch.float64)[:, None]
    metrics = task.metrics(task.metric_sums(prediction, data.y_test), len(data.y_test))
    mean, std = metrics["target_mean"], metrics["target_std"]
    grams = frame["y"].to_numpy()
    unscaled = data.y_train.numpy()[:, 0] * std + mean
    train_rows = np.isclose(grams[:, None], unscaled[None, :], rtol=0, atol=1e-6).any(axis=1)
    assert train_rows.sum() == task.n_train  # the scaling's inverse gives back the train rows of the file
    assert mean == pytest.approx(grams[train_rows].mean()) and std == pytest.approx(grams[train_rows].std())
    assert abs(mean - grams.mean()) > 1e-3  # the test rows were not part of it
    error = (prediction - data.y_test).numpy() * std  # the same predictions, in the target's units
    assert metrics["rmse_unscaled"] == pytest.approx(math.sqrt((error**2).mean()))
    assert metrics["mse_unscaled"] == pytest.approx(metrics["mse"] * std**2)


def test_several_targets_are_scored_each_in_its_own_units(tmp_path):
    frame = survey().drop(columns=["colour", "size"]).dropna().assign(z=lambda f: f["c"] * 1e-3)
    task = parse_experiment(
        experiment(
            {"path": write(frame, tmp_path / "two.csv"), "target": ["y", "z"], "features": ["a", "b"]}, [2, 2, 2]
        )
    ).task
    data = task.generate(seed=0)
    metrics = task.metrics(task.metric_sums(data.y_test + 0.5, data.y_test), len(data.y_test))
    assert "mse_unscaled" not in metrics  # no one number mixes grams and other units
    for j, column in enumerate(["y", "z"]):
        assert metrics[f"rmse_unscaled[{j}]"] == pytest.approx(0.5 * metrics[f"target_std[{j}]"])
        assert metrics[f"target_std[{j}]"] == pytest.approx(frame[column].std(ddof=0), rel=0.5)


def test_several_label_columns_are_refused_whatever_the_options(tmp_path):
    frame = pd.DataFrame({"a": np.arange(6.0), "y": list("ababab"), "z": list("ccdddd")})
    (line,) = problems(
        {"path": write(frame, tmp_path / "labels.csv"), "target": ["y", "z"], "objective": "classification"},
        ["task.missing=drop"],
    )
    assert "is not one column of labels (shape (6, 2)); a classification has one target" in line, line


def test_a_step_larger_than_a_files_split_is_told_the_files_fix_and_following_it_fits(tmp_path):
    """A file has the rows it has: the refusal offers a smaller test share (or a smaller batch),
    never task.n_train, which a file task has no field for; following it, the step fits."""
    from strategies.lifecycle.preflight import check_batch_fits_data

    frame = survey().dropna()[["a", "b", "c", "y"]]
    path = write(frame, tmp_path / "clean.csv")
    cfg = parse_experiment(experiment({"path": path, "target": "y", "test_fraction": 0.5}, [3, 2, 1]))
    step = cfg.task.n_train + 2
    with pytest.raises(ConfigError) as err:
        check_batch_fits_data(cfg.training, cfg.task, 1, step)
    assert "n_train" not in str(err.value).replace("training split", "")
    share = str(err.value).split("task.test_fraction to at most ")[1].split()[0]
    fixed = parse_experiment(experiment({"path": path, "target": "y", "test_fraction": float(share)}, [3, 2, 1]))
    check_batch_fits_data(fixed.training, fixed.task, 1, step)


def test_a_newcomers_table_is_refused_once_with_every_fix_and_following_them_fits(tmp_path):
    """No target named, text columns, missing cells, a model that does not fit the encoded inputs
    and a step larger than the split: one refusal names the target, every cell problem, the inputs
    the model must take and the most a step takes; following it, the experiment validates and its
    step fits (it took four rounds before)."""
    from strategies.lifecycle.preflight import check_batch_fits_data

    frame = survey().drop(columns=["y"])
    frame["price"] = np.arange(ROWS, dtype=float)
    path = write(frame, tmp_path / "houses.csv")
    lines = problems({"path": path})
    assert (
        lines[0].startswith(f"task.target: name the target column of {path}") and "--set task.target=price" in lines[0]
    )
    assert any("column 'colour'" in line for line in lines) and any("missing value" in line for line in lines)
    (line,) = [line for line in lines if line.startswith("task: to train on")]
    inputs = int(line.split("model.widths then starts with ")[1].split(",")[0])
    most = int(line.split("a step takes at most the ")[1].split()[0])
    fixed = {"path": path, "target": "price", "categorical": "onehot", "missing": "drop"}
    cfg = parse_experiment(experiment(fixed, [inputs, 2, 1]))
    assert cfg.task.input_dim == inputs and cfg.task.n_train == most
    check_batch_fits_data(cfg.training.model_copy(update={"micro_batch": most}), cfg.task, 1, most)
