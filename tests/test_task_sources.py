"""Tasks beyond the synthetic targets: regression and classification objectives with known
answers (r2 left out where the test targets have no spread), file tasks (CSV, Parquet, NumPy)
with their errors, scikit-learn's bundled datasets, pykan's Feynman equations, and
classification trained under every CPU strategy."""

import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from kan_models.tasks import OBJECTIVES
from kanscale.errors import ConfigError
from strategies.experiment import parse_experiment
from strategies.loop.trainer import train
from tests.helpers.launch import run_jobs

ROOT = Path(__file__).resolve().parents[1]


def experiment(task: dict, widths: list[int], out: Path | str = "runs", **training) -> dict:
    return {
        "name": "tasks",
        "model": {"family": "bspline", "widths": widths, "grid": 5, "grid_range": [-3.0, 3.0]},
        "task": task,
        "training": {"lr": 0.01, "micro_batch": 128, "warmup_steps": 2, **training},
        "runtime": {"device": "cpu", "threads": 1},
        "output": {"dir": str(out)},
    }


def parse(task: dict, widths: list[int]):
    return parse_experiment(experiment(task, widths))


# ---------------------------------------------------------------------------- objectives


def test_regression_metrics_have_their_textbook_values():
    goal = OBJECTIVES["regression"]
    prediction = torch.tensor([[1.0, 0.0], [2.0, 1.0], [4.0, 1.0]])
    target = torch.tensor([[1.0, 0.0], [3.0, 2.0], [5.0, 1.0]])
    assert goal.loss_sum(prediction, target).item() == pytest.approx((0 + 1 + 0.5) / 1)  # (0+0)/2 + (1+1)/2 + (1+0)/2
    halves = [goal.metric_sums(prediction[:2], target[:2]), goal.metric_sums(prediction[2:], target[2:])]
    sums = {k: halves[0][k] + halves[1][k] for k in halves[0]}  # additive: shards add up
    metrics = goal.metrics(sums, 3)
    assert metrics["mse"] == pytest.approx(3 / 6) and metrics["rmse"] == pytest.approx(math.sqrt(0.5))
    r2 = [1 - 2 / (35 - 81 / 3), 1 - 1 / (5 - 9 / 3)]  # per output: 1 - SSE / (sum y^2 - (sum y)^2 / n)
    assert metrics["r2"] == pytest.approx(sum(r2) / 2)


@pytest.mark.parametrize("width", [1, 3])
def test_the_regression_loss_and_its_gradient_are_the_squared_error_averaged_over_outputs(width):
    """One output and several: each sample's mean squared error, summed; its gradient 2 (p - t) / width."""
    generator = torch.Generator().manual_seed(width)
    prediction = torch.randn(5, width, dtype=torch.float64, generator=generator, requires_grad=True)
    target = torch.randn(5, width, dtype=torch.float64, generator=generator)
    loss = OBJECTIVES["regression"].loss_sum(prediction, target)
    loss.backward()
    squared = (prediction.detach() - target) ** 2
    assert loss.item() == pytest.approx(float(squared.sum()) / width, rel=1e-12)
    assert torch.allclose(prediction.grad, 2 * (prediction.detach() - target) / width, rtol=1e-12, atol=0)


def test_classification_metrics_have_their_textbook_values():
    goal = OBJECTIVES["classification"]
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0], [1.0, 0.0, 0.0]])
    labels = torch.tensor([0, 1, 2])
    expected = torch.nn.functional.cross_entropy(logits, labels, reduction="sum").item()
    assert goal.loss_sum(logits, labels).item() == pytest.approx(expected)
    metrics = goal.metrics(goal.metric_sums(logits, labels), 3)
    assert metrics["accuracy"] == pytest.approx(2 / 3) and metrics["log_loss"] == pytest.approx(expected / 3)


# ---------------------------------------------------------------------------- file tasks


@pytest.fixture
def table(tmp_path) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    frame = pd.DataFrame({"a": rng.normal(5, 2, 200), "b": rng.uniform(-1, 1, 200), "id": np.arange(200)})
    frame["y"] = frame["a"] * 0.5 + frame["b"] ** 2
    frame["kind"] = np.where(frame["b"] > 0, "up", "down")
    return frame


def test_a_csv_file_task_splits_by_fraction_and_standardises_on_train_only(tmp_path, table):
    table.to_csv(tmp_path / "data.csv", index=False)
    cfg = parse(
        {
            "name": "file",
            "path": str(tmp_path / "data.csv"),
            "target": "y",
            "features": ["a", "b"],
            "test_fraction": 0.25,
        },
        [2, 8, 1],
    )
    assert (cfg.task.input_dim, cfg.task.output_dim, cfg.task.n_train, cfg.task.n_test) == (2, 1, 150, 50)
    data = cfg.task.generate(seed=0)
    assert (
        data.x_train.mean(dim=0).abs().max() < 1e-9
        and data.x_train.std(dim=0, unbiased=False).sub(1).abs().max() < 1e-9
    )
    assert data.x_test.mean(dim=0).abs().max() > 1e-3  # the test split was not used to fit the scaling
    assert torch.equal(data.x_train, cfg.task.generate(seed=0).x_train)
    assert not torch.equal(data.x_train, cfg.task.generate(seed=1).x_train)  # the seed decides the split
    # a file's regression target is standardised by default, by the train split alone
    assert data.y_train.mean().abs() < 1e-9 and data.y_train.std(unbiased=False).sub(1).abs() < 1e-9
    assert data.y_test.mean().abs() > 1e-3
    given = parse({**cfg.task.model_dump(), "standardize_target": False}, [2, 8, 1]).task.generate(seed=0)
    assert given.y_train.mean().abs() > 1  # targets as given


def test_csv_parquet_and_numpy_hold_the_same_task(tmp_path, table):
    table.to_csv(tmp_path / "t.csv", index=False)
    table.to_parquet(tmp_path / "t.parquet")
    np.save(tmp_path / "t.npy", table[["a", "b", "y"]].to_numpy())
    np.savez(tmp_path / "t.npz", x=table[["a", "b"]].to_numpy(), y=table["y"].to_numpy())
    tasks = [
        {"name": "file", "path": str(tmp_path / "t.csv"), "target": "y", "features": ["a", "b"]},
        {"name": "file", "path": str(tmp_path / "t.parquet"), "target": "y", "features": ["a", "b"]},
        {"name": "file", "path": str(tmp_path / "t.npy")},  # the last column is the target
        {"name": "file", "path": str(tmp_path / "t.npz")},
    ]
    datasets = [parse(task, [2, 8, 1]).task.generate(seed=3) for task in tasks]
    for data in datasets[1:]:
        assert torch.allclose(data.x_train, datasets[0].x_train) and torch.allclose(data.y_test, datasets[0].y_test)


def test_a_classification_file_numbers_its_labels_and_several_targets_make_several_outputs(tmp_path, table):
    table.to_csv(tmp_path / "t.csv", index=False)
    labelled = parse(
        {
            "name": "file",
            "path": str(tmp_path / "t.csv"),
            "target": "kind",
            "features": ["a", "b"],
            "objective": "classification",
        },
        [2, 8, 2],
    )
    data = labelled.task.generate(0)
    assert labelled.task.output_dim == 2 and data.y_train.dtype == torch.int64 and set(data.y_train.tolist()) == {0, 1}
    two = parse({"name": "file", "path": str(tmp_path / "t.csv"), "target": ["y", "a"], "features": ["b"]}, [1, 8, 2])
    assert two.task.output_dim == 2 and two.task.generate(0).y_train.shape == (160, 2)


@pytest.mark.parametrize(
    "content,task,message",
    [
        ("a,y\n1,2\n3,4\n", {"target": "price"}, "task.target: no column 'price' in {path}; its columns: a, y"),
        (
            "a,y\n1,2\n3,4\n",
            {"target": "y", "features": ["a", "b"]},
            "task.features: no column 'b' in {path}; its columns: a, y",
        ),
        ("a,y\n1,2\nseven,4\n", {"target": "y"}, "task.features: column 'a' of {path} is not numeric (row 2: 'seven')"),
        (
            "a,y\n1,2\n,4\n3,5\n",
            {"target": "y"},
            "task.features: column 'a' of {path} has 1 missing value(s) (NaN), the first in row 2",
        ),
        ("a,y\n1,2\n3,\n", {"target": "y"}, "task.target: column 'y' of {path} has 1 missing value(s) (NaN)"),
        ("", {"target": "y"}, "task.path: {path} is empty"),
        ("a,y\n", {"target": "y"}, "task.path: {path} has no rows (columns: a, y)"),
        (
            "a,y\n1,2\n",
            {"target": "y"},
            "task.path: {path} holds 1 sample(s); a train and a test split need at least 2",
        ),
        ("a,y\n1,2\n3,4\n", {}, "task.target: name the target column of {path} (its columns: a, y)"),
    ],
)
def test_a_bad_file_is_refused_naming_the_field_and_the_fix(tmp_path, content, task, message):
    path = tmp_path / "bad.csv"
    path.write_text(content)
    with pytest.raises(ConfigError) as err:
        parse({"name": "file", "path": str(path), **task}, [1, 4, 1])
    assert message.format(path=path) in str(err.value)


def test_missing_files_unknown_formats_and_pickles_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"task\.path: .*nowhere\.csv: No such file or directory"):
        parse({"name": "file", "path": str(tmp_path / "nowhere.csv"), "target": "y"}, [1, 4, 1])
    (tmp_path / "data.xlsx").write_text("x")
    with pytest.raises(ConfigError, match=r"not a file kanscale reads; give one of \.csv, \.parquet, \.npy, \.npz"):
        parse({"name": "file", "path": str(tmp_path / "data.xlsx")}, [1, 4, 1])
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}, {"b": 2}], dtype=object))  # would need unpickling
    with pytest.raises(
        ConfigError, match="cannot be read as npy: Object arrays cannot be loaded when allow_pickle=False"
    ):
        parse({"name": "file", "path": str(tmp_path / "objects.npy")}, [1, 4, 1])


# ---------------------------------------------------------------------------- bundled and formula tasks


@pytest.mark.parametrize(
    "dataset,inputs,outputs,samples,goal",
    [
        ("digits", 64, 10, 1797, "classification"),
        ("wine", 13, 3, 178, "classification"),
        ("breast_cancer", 30, 2, 569, "classification"),
        ("iris", 4, 3, 150, "classification"),
        ("diabetes", 10, 1, 442, "regression"),
    ],
)
def test_scikit_learns_bundled_datasets_are_named_tasks(dataset, inputs, outputs, samples, goal):
    cfg = parse({"name": "sklearn", "dataset": dataset}, [inputs, 4, outputs])
    assert cfg.task.n_train + cfg.task.n_test == samples and cfg.task.goal.name == goal


def test_feynman_equations_come_from_pykan_with_their_ranges():
    cfg = parse({"name": "feynman", "equation": "I.6.20", "n_train": 500, "n_test": 100}, [2, 4, 1])
    data = cfg.task.generate(0)
    theta, sigma = data.x_test[:, 0], data.x_test[:, 1]
    assert sigma.min() >= 0.5 and sigma.max() <= 2.0  # pykan's range for sigma
    expected = torch.exp(-(theta**2) / (2 * sigma**2)) / torch.sqrt(2 * math.pi * sigma**2)
    assert torch.allclose(data.y_test[:, 0], expected)
    with pytest.raises(ConfigError, match=re.escape("task.equation: 'I.99' is not one of pykan's Feynman equations")):
        parse({"name": "feynman", "equation": "I.99"}, [2, 4, 1])


# ---------------------------------------------------------------------------- training


def test_a_csv_task_trains_from_the_command_line(tmp_path, table):
    from launchers.cli import main

    table.to_csv(tmp_path / "houses.csv", index=False)
    config = tmp_path / "houses.yaml"
    config.write_text(f"""
name: houses
model: {{family: bspline, widths: [2, 8, 1], grid: 5, grid_range: [-3.0, 3.0]}}
task: {{name: file, path: {tmp_path / "houses.csv"}, target: y, features: [a, b]}}
training: {{lr: 0.02, micro_batch: 32, epochs: 20, warmup_steps: 2}}
runtime: {{device: cpu, threads: 1}}
output: {{dir: {tmp_path / "runs"}}}
""")
    assert main(["train", str(config), "--no-progress"]) == 0
    (_run_dir,) = (tmp_path / "runs").iterdir()
    record = train(
        parse_experiment(
            experiment(
                {"name": "file", "path": str(tmp_path / "houses.csv"), "target": "y", "features": ["a", "b"]},
                [2, 8, 1],
                tmp_path / "again",
                epochs=20,
                lr=0.02,
                micro_batch=32,
            )
        ),
        show_progress=False,
    ).record
    assert (
        set(record.test_metrics) == {"mse", "rmse", "r2", "mse_unscaled", "rmse_unscaled", "target_mean", "target_std"}
        and record.test_metrics["r2"] > 0.8
    )
    assert record.task.name == "file" and record.task.n_train == 160


DIGITS_ACCURACY = 0.9  # a [64, 32, 10] B-spline KAN after 8 epochs reaches about 0.97 in one process
CPU_STRATEGIES = {
    "ddp": {"name": "ddp"},
    "fsdp1": {"name": "fsdp1"},
    "fsdp2": {"name": "fsdp2"},
    "zero1": {"name": "deepspeed", "zero_stage": 1},
    "zero2": {"name": "deepspeed", "zero_stage": 2},
    "zero3": {"name": "deepspeed", "zero_stage": 3},
    "accelerate": {"name": "accelerate"},
}


@pytest.mark.slow  # the slow tier (make test-slow)
def test_a_bundled_classification_reaches_its_accuracy_under_every_cpu_strategy(tmp_path):
    base = experiment(
        {"name": "sklearn", "dataset": "digits"},
        [64, 32, 10],
        tmp_path / "runs",
        epochs=8,
        micro_batch=None,
        global_batch=128,
    )
    jobs = [{"id": key, "config": {**base, "strategy": strategy}} for key, strategy in CPU_STRATEGIES.items()]
    results = run_jobs(jobs, tmp_path)
    single = train(parse_experiment(base), show_progress=False).record.test_metrics
    for key in CPU_STRATEGIES:
        metrics = results[key]["test_metrics"]
        assert metrics["accuracy"] >= DIGITS_ACCURACY, (key, metrics)
        assert metrics["accuracy"] == pytest.approx(single["accuracy"], abs=0.02), (key, metrics, single)


def test_r2_is_left_out_where_the_test_targets_have_no_spread():
    goal = OBJECTIVES["regression"]
    for target in (
        torch.full((999, 1), 0.0137),
        torch.full((1, 1), 3.0),  # 0.0137 x 999: r2 -3.6e15 before
        torch.cat([torch.linspace(0, 1, 50)[:, None], torch.full((50, 1), 0.3)], dim=1),
    ):
        metrics = goal.metrics(goal.metric_sums(target + 0.01, target), len(target))
        assert set(metrics) == {"mse", "rmse"} and metrics["mse"] == pytest.approx(1e-4, rel=1e-3)
    spread = torch.linspace(0, 1, 50)[:, None]
    assert goal.metrics(goal.metric_sums(spread + 0.01, spread), 50)["r2"] == pytest.approx(
        1 - 1e-4 / spread.var(unbiased=False).item()
    )


def test_a_run_on_a_constant_target_records_no_r2(tmp_path):
    rows = ["a,b,y"] + [f"{i / 40:.3f},{(i * 7 % 40) / 40:.3f},2.5" for i in range(40)]
    (tmp_path / "flat.csv").write_text("\n".join(rows) + "\n")
    cfg = parse_experiment(
        {
            "name": "flat",
            "model": {"family": "bspline", "widths": [2, 4, 1], "grid": 3},
            "task": {"name": "file", "path": str(tmp_path / "flat.csv"), "target": "y"},
            "training": {"steps": 3, "epochs": None, "micro_batch": 8, "warmup_steps": 1},
            "measurement": {"window_steps": 1, "baseline": "off"},
            "runtime": {"device": "cpu", "threads": 1},
            "output": {"dir": str(tmp_path / "runs")},
        }
    )
    metrics = train(cfg, show_progress=False).record.test_metrics
    assert "r2" not in metrics and math.isfinite(metrics["mse"])
    # the file's target is standardised by default: a constant one is only centred (divided by 1)
    assert (metrics["target_mean"], metrics["target_std"]) == (2.5, 1.0)
    assert metrics["mse_unscaled"] == pytest.approx(metrics["mse"])
    (summary,) = (tmp_path / "runs").glob("*/summary.json")
    assert "r2" not in json.loads(summary.read_text())["test_metrics"]
