"""Issue 28's new cases about configs (report cases 1, 2, 3, 10, 12, 14, 27): each bad input is
refused before launch naming its field, and what a run records is what it measured."""

import json
import math
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from kan_models import count_parameters, parse_model_config
from kan_models.tasks import OBJECTIVES
from kanscale.errors import ConfigError
from launchers.studies.study import load_study
from strategies.experiment import load_experiment, parse_experiment
from strategies.lifecycle.preflight import preflight
from strategies.loop.trainer import train

ROOT = Path(__file__).resolve().parents[1]


def refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_experiment("quickstart", list(overrides))
    return str(err.value)


# ------------------------------------------------------------------ case 1: a boolean is no number


@pytest.mark.parametrize(
    "override, field, wanted",
    [
        ("model.widths=[2,true,1]", "model.widths[1]", "an integer"),
        ("training.micro_batch=true", "training.micro_batch", "an integer"),
        ("runtime.threads=on", "runtime.threads", "an integer"),  # YAML 1.1: on is true
        ("task.n_test=yes", "task.n_test", "an integer"),
        ("training.lr=true", "training.lr", "a number"),
        ("training.betas=[0.9, false]", "training.betas[1]", "a number"),
        ("model.wrap={min_params: true}", "model.wrap.min_params", "an integer"),
        ("fault={rank: true, step: 1}", "fault.rank", "an integer"),
    ],
)
def test_a_boolean_for_a_number_is_refused_naming_the_place(override, field, wanted):
    message = refused(override)
    assert f"{field}: " in message and "is a boolean, not a number" in message and f"give {wanted}" in message


def test_a_boolean_field_still_takes_a_boolean_and_a_study_refuses_repeats_true(tmp_path):
    pykan = parse_model_config({"family": "pykan", "widths": [2, 3, 1], "symbolic_enabled": False, "save_act": True})
    assert pykan.symbolic_enabled is False and pykan.save_act is True
    study = tmp_path / "s.yaml"
    study.write_text("study: s\nexperiment: quickstart\nrepeats: true\nmatrix: {strategy: [single]}\n")
    with pytest.raises(ConfigError, match=r"repeats: true is a boolean, not a number; give an integer"):
        load_study(study)


# ------------------------------------------------------------------ case 2: the seed's range


@pytest.mark.parametrize("seed", ["-1", "4294967296", "1180591620717411303424"])  # 2**32, 2**70
def test_a_seed_numpy_or_torch_refuse_is_refused_before_launch(seed):
    assert "training.seed: " in refused(f"training.seed={seed}")


def test_the_largest_seed_allowed_seeds_everything_it_reaches():
    cfg = load_experiment("quickstart", ["training.seed=4294967295", "task.n_train=8", "task.n_test=4"])
    data = cfg.task.generate(cfg.training.seed)  # numpy's SeedSequence
    torch.manual_seed(cfg.training.seed)
    np.random.seed(cfg.training.seed)  # what pykan's constructor does with it
    assert data.x_test.shape == (4, 2)
    assert "model.seed: " in refused("model={family: pykan, widths: [2, 3, 1], seed: -1}")


# ------------------------------------------------------------------ case 3: runtime.timeout_s floor


def test_a_timeout_too_short_to_form_a_process_group_is_refused():
    assert "runtime.timeout_s: Input should be greater than or equal to 1" in refused("runtime.timeout_s=0.001")
    assert load_experiment("quickstart", ["runtime.timeout_s=1"]).runtime.timeout_s == 1.0


# ------------------------------------------------------------------ case 10: r2 where it is undefined


def test_one_test_sample_is_refused():
    assert "task.n_test: Input should be greater than or equal to 2" in refused("task.n_test=1")


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


# ------------------------------------------------------------------ cases 12 and 14: custom models


FACTORIES = textwrap.dedent("""
    from torch import nn

    def frozen():
        model = nn.Linear(2, 1)
        model.requires_grad_(False)
        return model

    class Sum(nn.Module):  # the right output shape, and nothing to learn
        def forward(self, x):
            return x.sum(dim=1, keepdim=True)

    def empty():
        return Sum()

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = nn.Linear(2, 2), nn.Linear(2, 1)
            self.l3 = self.l1  # the same module, so its weight and bias, under a second name

        def forward(self, x):
            return self.l2(self.l3(self.l1(x)))

    def tied():
        return Tied()
""")


def custom(tmp_path: Path, function: str, widths: list[int]) -> dict:
    (tmp_path / "facs.py").write_text(FACTORIES)
    return {
        "name": "c",
        "model": {"family": "custom", "widths": widths, "factory": f"{tmp_path / 'facs.py'}:{function}"},
        "task": {"name": "quadratic", "n_train": 64, "n_test": 16},
        "training": {"steps": 3, "epochs": None, "micro_batch": 16, "warmup_steps": 1},
        "measurement": {"window_steps": 1, "baseline": "off"},
        "runtime": {"device": "cpu", "threads": 1},
        "output": {"dir": str(tmp_path / "runs")},
    }


@pytest.mark.parametrize(
    "function, why", [("frozen", "all 2 of its parameters have requires_grad=False"), ("empty", "it has no parameters")]
)
def test_a_custom_model_with_nothing_to_train_is_refused_before_launch(tmp_path, function, why):
    cfg = parse_experiment(custom(tmp_path, function, [2, 1]))
    with pytest.raises(ConfigError, match=r"model\.factory: .* builds a model with no trainable parameter") as err:
        preflight(cfg, "cpu", 1)
    assert why in str(err.value)
    assert not (tmp_path / "runs").exists()


def test_tied_weights_are_counted_once(tmp_path):
    cfg = parse_experiment(custom(tmp_path, "tied", [2, 1]))
    assert cfg.model.parameter_count() == count_parameters(cfg.model.build())  # the sketch and the real model agree
    count = cfg.model.parameter_count()
    assert (count.trainable, count.total) == (9, 9)  # Linear(2, 2) 6 + Linear(2, 1) 3, l3 being l1
    record = train(cfg, show_progress=False).record
    assert record.status == "ok" and (record.model.params_trainable, record.model.params_total) == (9, 9)


# ------------------------------------------------------------------ case 27: a study's points are distinct


@pytest.mark.parametrize(
    "matrix, include, expected",
    [
        ("{strategy: [single, single]}", "[]", "matrix: axis strategy gives 'single' twice; .* set repeats: N"),
        ("{model.widths: [[2, 8, 1], [2, 8, 1]]}", "[]", r"axis model.widths gives \[2, 8, 1\] twice"),
        (
            "{task.n_train: [64, '64']}",
            "[]",
            "axis task.n_train gives 64 and '64', which both name the point n_train=64",
        ),
        (
            "{strategy: [single, ddp], topology: [1x1, 1x2]}",
            "[{topology: 1x2, strategy: ddp}]",
            r"include\[0\] \(topology=1x2_strategy=ddp\) is already a point of the matrix .* set repeats: N",
        ),
    ],
)
def test_a_point_given_twice_is_refused_naming_the_axis(tmp_path, matrix, include, expected):
    study = tmp_path / "twice.yaml"
    study.write_text(f"study: twice\nexperiment: quickstart\nmatrix: {matrix}\ninclude: {include}\n")
    with pytest.raises(ConfigError, match=expected):
        load_study(study)
