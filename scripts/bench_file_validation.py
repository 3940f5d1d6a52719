"""How long does validating a file task take as the file gets wider (or taller)? Writes a table of
random numbers (the last column the target) at each width, then times what the experiment's
validation does with it (``task: {name: file}`` read and checked: kan_models/tasks/files.py)
and, when it is accepted, the tensors a run builds from it (split, standardised, cast).

    python scripts/bench_file_validation.py                              # 3 rows x 10k, 100k, 10^6 columns
    python scripts/bench_file_validation.py --formats csv parquet npy --widths 10000 30000
    python scripts/bench_file_validation.py --rows 200000 --widths 50 --objective classification

Prints one line per file: its shape and format, then "accepted in" the validation's seconds and
the tensors' seconds, or "refused in" the seconds and the message. The columns counted are all
of the file's, the target's included. Generating the files is not timed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from pydantic import ValidationError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kan_models.tasks import FileTask


def write(folder: Path, rows: int, width: int, fmt: str, objective: str) -> dict:
    """A file of ``rows`` x ``width`` (inputs c0.., target y) and the task options that read it."""
    values = np.random.default_rng(width).normal(size=(rows, width)).round(4)
    path = folder / f"t{rows}x{width}.{fmt}"
    labels = np.where(values[:, -1] > 0, "up", "down")
    if fmt == "csv":  # written as text directly: pandas' writer is itself slow at a million columns
        with open(path, "w") as file:
            file.write(",".join([f"c{i}" for i in range(width - 1)] + ["y"]) + "\n")
            for row, label in zip(values, labels, strict=True):
                file.write(",".join(map(str, row[:-1])) + f",{label if objective == 'classification' else row[-1]}\n")
        return {"path": str(path), "target": "y"}
    if fmt == "parquet":
        frame = pd.DataFrame(values, columns=[f"c{i}" for i in range(width - 1)] + ["y"])
        if objective == "classification":
            frame["y"] = labels
        frame.to_parquet(path)
        return {"path": str(path), "target": "y"}
    if objective == "classification":  # an .npy array has one dtype: labels go in an .npz beside the inputs
        path = path.with_suffix(".npz")
        np.savez(path, x=values[:, :-1], y=labels)
        return {"path": str(path)}
    np.save(path, values)
    return {"path": str(path)}


def measure(options: dict, objective: str) -> str:
    start = time.perf_counter()
    try:
        task = FileTask(name="file", objective=objective, **options)
    except ValidationError as err:
        message = err.errors()[0]["msg"].removeprefix("Value error, ")
        return f"refused in {time.perf_counter() - start:6.2f} s: {message}"
    checked = time.perf_counter() - start
    start = time.perf_counter()
    data = task.generate(seed=0).to("cpu", torch.float32)
    built = time.perf_counter() - start
    return (
        f"accepted in {checked:6.2f} s ({task.input_dim:,} inputs, {task.output_dim} output(s)); tensors "
        f"{tuple(data.x_train.shape)} in {built:.2f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--widths",
        type=int,
        nargs="+",
        default=[10_000, 100_000, 1_000_000],
        help="columns of each file, the target's included",
    )
    parser.add_argument("--rows", type=int, default=3)
    parser.add_argument("--formats", nargs="+", choices=["csv", "parquet", "npy"], default=["csv", "npy"])
    parser.add_argument("--objective", choices=["regression", "classification"], default="regression")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        for width in args.widths:
            for fmt in args.formats:
                options = write(Path(folder), args.rows, width, fmt, args.objective)
                print(
                    f"{args.rows:>9,} x {width:>9,} {Path(options['path']).suffix[1:]:<7} "
                    f"{measure(options, args.objective)}",
                    flush=True,
                )
                Path(options["path"]).unlink()


if __name__ == "__main__":
    main()
