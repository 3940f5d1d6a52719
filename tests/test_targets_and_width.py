"""File tasks: every way a target can be missing, fed to the model, or not a number is refused
before launch with the field, the file, the rows and values, and the fix, in every format the
file task reads; and validation stays vectorised, so a wide file is checked in seconds or
refused, from its header alone, above the documented width (docs/configuration.md)."""

import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from kan_models.tasks.files import MAX_COLUMNS
from kanscale.errors import ConfigError
from launchers.cli import main
from strategies.experiment import parse_experiment

ROOT = Path(__file__).resolve().parents[1]


def experiment(task: dict, widths: list[int], out: Path | str = "runs") -> dict:
    return {
        "name": "targets",
        "model": {"family": "bspline", "widths": widths, "grid": 3},
        "task": {"name": "file", **task},
        "training": {"micro_batch": 2, "steps": 1, "warmup_steps": 0},
        "runtime": {"device": "cpu", "threads": 1},
        "output": {"dir": str(out)},
    }


def refusal(task: dict, widths: list[int] = (2, 2, 2)) -> str:
    with pytest.raises(ConfigError) as err:
        parse_experiment(experiment(task, list(widths)))
    return str(err.value)


def table(rows: int = 6) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    return pd.DataFrame(
        {"a": rng.normal(size=rows), "b": rng.normal(size=rows), "y": np.where(np.arange(rows) % 2 == 0, "cat", "dog")}
    )


# ---------------------------------------------------------------------------- a missing class label


def write_missing_label(folder: Path, kind: str) -> dict:
    """A file whose target has no label in rows 3 and 5 (1-based), and the task options naming it."""
    frame = table()
    holes = [2, 4]
    if kind == "csv numeric":  # numbered, an empty cell was NaN: a class of its own
        frame["y"] = np.arange(6) % 2
        path = folder / "numeric.csv"
        frame.to_csv(path, index=False)
        text = path.read_text().splitlines()
        path.write_text(
            "\n".join(line[: line.rindex(",") + 1] if i - 1 in holes else line for i, line in enumerate(text)) + "\n"
        )
        return {"path": str(path), "target": "y"}
    if kind in ("csv strings", "csv blank"):  # strings: NaN among them was a raw TypeError
        frame.loc[holes, "y"] = None if kind == "csv strings" else "  "
        path = folder / f"{kind.replace(' ', '_')}.csv"
        frame.to_csv(path, index=False)
        return {"path": str(path), "target": "y"}
    if kind in ("parquet strings", "parquet integers"):
        frame["y"] = (
            frame["y"].astype(object) if kind == "parquet strings" else pd.array(np.arange(6) % 2, dtype="Int64")
        )
        frame.loc[holes, "y"] = None
        path = folder / f"{kind.replace(' ', '_')}.parquet"
        frame.to_parquet(path)
        return {"path": str(path), "target": "y"}
    if kind == "npy":
        values = np.column_stack([frame[["a", "b"]].to_numpy(), np.arange(6) % 2.0])
        values[holes, -1] = np.nan
        np.save(folder / "t.npy", values)
        return {"path": str(folder / "t.npy")}
    labels = frame["y"].to_numpy(dtype=str) if kind == "npz strings" else np.arange(6) % 2.0
    labels[holes] = "" if kind == "npz strings" else np.nan
    np.savez(folder / f"{kind.replace(' ', '_')}.npz", x=frame[["a", "b"]].to_numpy(), y=labels)
    return {"path": str(folder / f"{kind.replace(' ', '_')}.npz")}


@pytest.mark.parametrize(
    "kind",
    [
        "csv numeric",
        "csv strings",
        "csv blank",
        "parquet strings",
        "parquet integers",
        "npy",
        "npz strings",
        "npz numbers",
    ],
)
def test_a_missing_class_label_is_refused_with_its_rows_in_every_format(tmp_path, kind):
    task = write_missing_label(tmp_path, kind)
    message = refusal({**task, "objective": "classification"})
    assert "task.target: " in message and f" of {task['path']} has 2 missing label(s)" in message, message
    assert "in row(s) 3, 5; a missing label is not a class: fill in those labels or drop those rows" in message


def test_a_regression_target_with_missing_values_names_its_column_and_rows(tmp_path):
    frame = pd.DataFrame({"a": np.arange(6.0), "y": [1.0, np.nan, 2.0, np.nan, 3.0, np.nan]})
    frame.to_csv(tmp_path / "r.csv", index=False)
    message = refusal({"path": str(tmp_path / "r.csv"), "target": "y"}, [1, 2, 1])
    assert (
        f"task.target: column 'y' of {tmp_path / 'r.csv'} has 3 missing value(s) (NaN), the first in row 2 "
        "(rows 2, 4, 6); fill or drop them" in message
    )


# ---------------------------------------------------------------------------- a target among the features


@pytest.mark.parametrize(
    "suffix,task,named",
    [
        (".csv", {"target": "y", "features": ["a", "y"]}, "column 'y'"),
        (".csv", {"target": "y", "features": "y"}, "column 'y'"),  # one name, not a list: still a column
        (".csv", {"target": ["y", "b"], "features": ["a", "b"]}, "column 'b'"),
        (".parquet", {"target": "y", "features": ["y", "a"]}, "column 'y'"),
        (".npy", {"features": [0, -1]}, "column 2"),  # the default target is the last column, 2
        (".npy", {"target": 0, "features": [0, 1]}, "column 0"),
        (".npz", {"features": "y"}, "'y'"),
    ],
)
def test_a_target_listed_among_the_features_is_refused(tmp_path, suffix, task, named):
    frame = table().assign(y=np.arange(6.0))
    path = tmp_path / f"t{suffix}"
    if suffix == ".csv":
        frame.to_csv(path, index=False)
    elif suffix == ".parquet":
        frame.to_parquet(path)
    elif suffix == ".npy":
        np.save(path, frame.to_numpy())
    else:
        np.savez(path, x=frame[["a", "b"]].to_numpy(), y=frame["y"].to_numpy())
    message = refusal({"path": str(path), **task}, [2, 2, 1])
    assert f"task.features: {named} of {path} is task.target too: the model would be fed its answer" in message, message


def test_the_default_features_leave_the_target_out(tmp_path):
    table().assign(y=np.arange(6.0) * 100).to_csv(tmp_path / "t.csv", index=False)
    cfg = parse_experiment(
        experiment(
            {"path": str(tmp_path / "t.csv"), "target": "y", "standardize": False, "standardize_target": False},
            [2, 2, 1],
        )
    )
    data = cfg.task.generate(0)
    assert cfg.task.input_dim == 2 and data.x_train.abs().max() < 10 <= data.y_train.max()  # no column is y's


@pytest.mark.parametrize(
    "suffix,task,message",
    [
        (
            ".csv",
            {"target": "y", "features": ["a", "a"]},
            "task.features: column 'a' of {path} is named more than once",
        ),
        (".npy", {"features": [0, 0]}, "task.features: column 0 of {path} is named more than once"),
        (".npy", {"features": ["a"]}, "task.features: give column indices of {path}'s 3 columns, got 'a'"),
        (".npz", {"features": ["x"]}, "task.features: an .npz file's inputs are one array (default x); give its key"),
        (".npz", {"target": 1}, "task.target: an .npz file's target is one array (default y); give its key, not 1"),
    ],
)
def test_a_feature_or_target_given_in_a_form_the_format_ignores_is_refused(tmp_path, suffix, task, message):
    frame = table().assign(y=np.arange(6.0))
    path = tmp_path / f"t{suffix}"
    if suffix == ".csv":
        frame.to_csv(path, index=False)
    elif suffix == ".npy":
        np.save(path, frame.to_numpy())
    else:
        np.savez(path, x=frame[["a", "b"]].to_numpy(), y=frame["y"].to_numpy())
    assert message.format(path=path) in refusal({"path": str(path), **task}, [2, 2, 1])


def test_the_cli_refuses_a_target_among_the_features_before_anything_is_written(tmp_path, capsys):
    table().to_csv(tmp_path / "t.csv", index=False)
    config = tmp_path / "e.yaml"
    config.write_text(
        yaml.safe_dump(
            experiment(
                {"path": str(tmp_path / "t.csv"), "target": "y", "features": ["a", "y"], "objective": "classification"},
                [2, 2, 2],
                tmp_path / "out",
            )
        )
    )
    assert main(["run", str(config)]) == 2
    err = capsys.readouterr().err
    assert "task.features: column 'y' of" in err and "Traceback" not in err and not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- a regression target that is not a number


@pytest.mark.parametrize("suffix", [".csv", ".parquet", ".npz", ".npy"])
def test_a_string_regression_target_names_row_and_value_and_the_fix_works(tmp_path, suffix):
    frame = table()
    path = tmp_path / f"t{suffix}"
    if suffix == ".csv":
        frame.to_csv(path, index=False)
    elif suffix == ".parquet":
        frame.to_parquet(path)
    elif suffix == ".npz":
        np.savez(path, x=frame[["a", "b"]].to_numpy(), y=frame["y"].to_numpy(dtype=str))
    else:  # one dtype for the whole array: numbers as text beside the labels
        np.save(path, frame.astype(str).to_numpy(dtype=str))
    task = {"path": str(path), **({"target": "y"} if suffix in (".csv", ".parquet") else {})}
    named = {".csv": "column 'y'", ".parquet": "column 'y'", ".npz": "array 'y'", ".npy": "column 2"}[suffix]
    message = refusal(task, [2, 2, 1])
    assert (
        f"task.target: {named} of {path} is not numeric (row 1: 'cat', and 5 more row(s)); a regression target "
        "is a number; if these are class labels, set task.objective: classification" in message
    ), message
    cfg = parse_experiment(experiment({**task, "objective": "classification"}, [2, 2, 2]))  # the fix it names
    assert cfg.task.output_dim == 2 and sorted(set(cfg.task.generate(0).y_train.tolist())) == [0, 1]


def test_a_partly_numeric_regression_target_names_its_first_bad_row(tmp_path):
    (tmp_path / "t.csv").write_text("a,y\n1,1.5\n2,2.5\n3,n/a?\n4,3\n")
    assert "task.target: column 'y' of" in (
        message := refusal({"path": str(tmp_path / "t.csv"), "target": "y"}, [1, 2, 1])
    )
    assert "is not numeric (row 3: 'n/a?'); a regression target is a number" in message


# ---------------------------------------------------------------------------- width


def wide_csv(path: Path, width: int, rows: int = 3, label: bool = False) -> np.ndarray:
    values = np.random.default_rng(width).normal(size=(rows, width)).round(3)
    with open(path, "w") as file:
        file.write(",".join([f"c{i}" for i in range(width - 1)] + ["y"]) + "\n")
        for i, row in enumerate(values):
            file.write(",".join(map(str, row[:-1])) + f",{'ab'[i % 2] if label else row[-1]}\n")
    return values


def test_a_20k_column_csv_is_checked_whole_and_its_bad_cell_found(tmp_path):
    wide_csv(tmp_path / "w.csv", 20_000, label=True)
    cfg = parse_experiment(
        experiment({"path": str(tmp_path / "w.csv"), "target": "y", "objective": "classification"}, [19_999, 2, 2])
    )
    assert cfg.task.input_dim == 19_999 and cfg.task.output_dim == 2
    data = cfg.task.generate(0)
    assert data.x_train.shape == (2, 19_999) and np.isfinite(data.x_train.numpy()).all()
    lines = (tmp_path / "w.csv").read_text().splitlines()
    cells = lines[2].split(",")
    cells[17_000] = ""  # one empty cell, deep in row 2
    lines[2] = ",".join(cells)
    (tmp_path / "w.csv").write_text("\n".join(lines) + "\n")
    message = refusal({"path": str(tmp_path / "w.csv"), "target": "y", "objective": "classification"})
    assert (
        "task.features: column 'c17000' of" in message and "has 1 missing value(s) (NaN), the first in row 2" in message
    )


def test_a_csv_wider_than_the_limit_is_refused_from_its_header_and_the_fix_works(tmp_path):
    width = MAX_COLUMNS[".csv"] + 1
    values = wide_csv(tmp_path / "w.csv", width, rows=2)
    message = refusal({"path": str(tmp_path / "w.csv"), "target": "y"})
    assert f"task.path: {tmp_path / 'w.csv'} has {width:,} columns, more than the {MAX_COLUMNS['.csv']:,}" in message
    assert "save the table as .npy (numpy.save) or .npz" in message
    np.save(tmp_path / "w.npy", values)  # the fix: the same table as .npy, the last column the target
    assert (
        parse_experiment(experiment({"path": str(tmp_path / "w.npy")}, [width - 1, 2, 1])).task.input_dim == width - 1
    )


def test_the_benchmark_prints_a_line_per_file(monkeypatch, capsys):
    monkeypatch.setattr(
        sys,
        "argv",
        ["bench_file_validation.py", "--widths", "40", "--formats", "csv", "npy", "--objective", "classification"],
    )
    runpy.run_path(str(ROOT / "scripts/bench_file_validation.py"), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[3] for line in lines] == ["csv", "npz"]  # labels beside .npy inputs go in an .npz
    assert all("accepted in" in line and "(39 inputs, 2 output(s))" in line for line in lines), lines


@pytest.mark.slow
def test_a_parquet_file_wider_than_the_limit_is_refused_from_its_metadata(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    width = MAX_COLUMNS[".parquet"] + 1
    pq.write_table(pa.table({f"c{i}": np.zeros(2) for i in range(width)}), tmp_path / "w.parquet")
    message = refusal({"path": str(tmp_path / "w.parquet"), "target": "c0"})
    assert (
        f"has {width:,} columns, more than the {MAX_COLUMNS['.parquet']:,} kanscale reads from a parquet file"
        in message
    )


@pytest.mark.slow
def test_the_documented_benchmark_runs_at_a_million_columns():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts/bench_file_validation.py")], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 6 and all(("accepted in" in line) != ("refused in" in line) for line in lines)
    assert "1,000,000 csv" in lines[4] and "refused in" in lines[4] and "accepted in" in lines[5]
