"""palmerpenguins' penguins.csv as the package ships it (read from the installed package, never a
copy: the data is CC0, the package in the dev extras): one validation names all its problems,
and with task.missing=drop and task.categorical=onehot it trains, species classification and
body-mass regression, to a sensible score in a short run, the regression standardised by default
and scored in grams too (docs/configuration.md, the README's command)."""

import importlib.resources
import json
from pathlib import Path

import pytest

from kanscale.errors import ConfigError
from launchers.cli import main
from strategies.experiment import parse_experiment
from strategies.loop.trainer import train

PENGUINS = str(importlib.resources.files("palmerpenguins") / "data" / "penguins.csv")
ROWS, KEPT = 344, 333  # the file's rows; those without a missing value (11 have one: sex, or all measurements)
FIX = ["task.missing=drop", "task.categorical=onehot"]
# Floors well below what 5 epochs reach for any seed, and well above what a model that learned
# nothing scores (predicting the largest class is 44% of the rows; an unstandardised target's r2
# is far below zero): docs/models.md (palmerpenguins) gives the figures.
ACCURACY, R2 = 0.85, 0.6
SPECIES = {"target": "species", "objective": "classification"}


def experiment(task: dict, widths: list[int], out: Path) -> dict:
    return {
        "name": "penguins",
        "model": {"family": "bspline", "widths": widths, "grid": 5, "grid_range": [-3.0, 3.0]},
        "task": {"name": "file", "path": PENGUINS, **task},
        "training": {"lr": 0.02, "micro_batch": 32, "epochs": 5, "warmup_steps": 2},
        "measurement": {"baseline": "off"},
        "runtime": {"device": "cpu", "threads": 1},
        "output": {"dir": str(out)},
    }


def refusal(task: dict, overrides: list[str] = ()) -> list[str]:
    with pytest.raises(ConfigError) as err:
        parse_experiment(experiment(task, [10, 8, 3], Path("runs")), list(overrides))
    return [line.removeprefix("  - ") for line in str(err.value).splitlines()[1:]]


def test_penguins_as_shipped_names_all_its_problems_in_one_run():
    lines = refusal(SPECIES)
    of = f"of {PENGUINS}"
    assert [line for line in lines if "is not numeric" in line] == [
        f"task.features: column 'island' {of} is not numeric (row 1: 'Torgersen', and 343 more row(s)); its 3 distinct "
        "value(s): Biscoe, Dream, Torgersen; encode it with --set task.categorical=onehot (or =codes), or leave it out "
        "of task.features",
        f"task.features: column 'sex' {of} is not numeric (row 1: 'male', and 332 more row(s)); its 2 distinct "
        "value(s): female, male; encode it with --set task.categorical=onehot (or =codes), or leave it out of "
        "task.features",
    ]
    missing = [line for line in lines if "missing value(s)" in line]
    for column in ("bill_length_mm", "bill_depth_mm", "flipper_length_mm", "body_mass_g"):
        assert (
            f"task.features: column '{column}' {of} has 2 missing value(s) (NaN), the first in row 4 (rows 4, 272); "
            "fill or drop them: --set task.missing=drop drops every row with a missing value" in missing
        )
    assert any(
        line.startswith(
            f"task.features: column 'sex' {of} has 11 missing value(s) (NaN), the first in row 4 "
            "(rows 4, 9, 10, 11, 12, 48, 179, 219, ... (11 in all))"
        )
        for line in missing
    )
    assert len(missing) == 5 and lines[-1] == (
        f"task: to train on {PENGUINS} as it is, set both: --set task.categorical=onehot --set task.missing=drop "
        f"(which drops {ROWS - KEPT} of its {ROWS} rows, leaving {KEPT} rows of 10 inputs: model.widths then "
        "starts with 10, and a step takes at most the 266 of the training split)"
    )
    regression = refusal({"target": "body_mass_g"})
    assert (
        f"task.target: column 'body_mass_g' {of} has 2 missing value(s) (NaN), the first in row 4 (rows 4, 272); "
        "fill or drop them: --set task.missing=drop drops every row with a missing value" in regression
    )
    assert sum("is not numeric" in line for line in regression) == 3  # species is an input here


def test_either_option_alone_leaves_what_the_other_mends():
    assert all("missing value" in line for line in refusal(SPECIES, FIX[1:]))
    assert all("is not numeric" in line for line in refusal(SPECIES, FIX[:1]))
    codes = parse_experiment(
        experiment(SPECIES, [7, 8, 3], Path("runs")), ["task.missing=drop", "task.categorical=codes"]
    )
    assert codes.task.input_dim == 7 and codes.task.n_train + codes.task.n_test == KEPT


def test_penguin_species_train_with_the_two_options(tmp_path):
    cfg = parse_experiment(experiment(SPECIES, [10, 8, 3], tmp_path), FIX)
    assert cfg.task.label == "file penguins.csv (11 row(s) with missing values dropped; one-hot: island, sex)"
    record = train(cfg, show_progress=False).record
    assert record.task.n_train + record.task.n_test == KEPT
    prepared = record.task.preparation  # the record says what was done to the file
    assert prepared["rows_dropped"] == 11 and prepared["first_rows_dropped"][0] == 4
    assert prepared["encoding"] == "onehot" and prepared["encoded"] == {
        "island": ["Biscoe", "Dream", "Torgersen"],
        "sex": ["female", "male"],
    }
    assert record.test_metrics["accuracy"] >= ACCURACY, record.test_metrics


def test_penguin_body_mass_is_standardised_by_default_and_scored_in_grams(tmp_path):
    cfg = parse_experiment(experiment({"target": "body_mass_g"}, [12, 8, 1], tmp_path), FIX)
    assert cfg.task.standardize_target and cfg.task.input_dim == 12  # species 3, island 3, sex 2 one-hot columns
    metrics = train(cfg, show_progress=False).record.test_metrics
    assert metrics["r2"] > R2, metrics
    assert 3500 < metrics["target_mean"] < 5000 and 500 < metrics["target_std"] < 1200  # grams, the train split's
    assert metrics["rmse_unscaled"] == pytest.approx(metrics["rmse"] * metrics["target_std"])
    assert metrics["rmse_unscaled"] < metrics["target_std"]  # better than predicting the mean


def test_the_readme_command_trains_penguins(tmp_path, capsys):
    code = main(
        [
            "train",
            "quickstart",
            "--set",
            f"task={{name: file, path: {PENGUINS}, target: species, objective: classification}}",
            "--set",
            "task.missing=drop",
            "--set",
            "task.categorical=onehot",
            "--set",
            "model.widths=[10,16,3]",
            "--set",
            "training.micro_batch=32",
            "--out",
            str(tmp_path),
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert (
        "task       file penguins.csv (11 row(s) with missing values dropped; one-hot: island, sex)  266 train / "
        "67 test samples" in out
    )
    (summary,) = tmp_path.glob("*/summary.json")
    assert json.loads(summary.read_text())["test_metrics"]["accuracy"] >= ACCURACY
