"""``model.family: custom``: a user's own nn.Module from a file outside the repository trains under
ddp, fsdp2 and zero3 with per-step parity to its one-process run; bad factories, and models with
nothing to train, are refused before launch; tied weights are counted once; the FSDP units follow the wrap policy."""

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from kan_models import count_parameters, parse_model_config
from kan_models.base import WrapPolicy
from kan_models.wrap import wrap_units
from kanscale.errors import ConfigError
from strategies.experiment import parse_experiment
from strategies.lifecycle.preflight import preflight
from strategies.loop.trainer import Trainer, train
from strategies.runtime.distributed import DistEnv
from tests.helpers.launch import child_env, run_here, run_jobs
from tests.helpers.parity import max_rel_diff

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12


def experiment(factory: str, out: str, strategy: dict | None = None) -> dict:
    return {
        "name": "custom",
        "model": {"family": "custom", "widths": [64, 10], "factory": factory, "options": {"hidden": [16], "grid": 4}},
        "task": {"name": "sklearn", "dataset": "digits"},
        "training": {"seed": 1, "lr": 0.01, "micro_batch": None, "global_batch": 64, "steps": STEPS, "warmup_steps": 2},
        "strategy": strategy or {"name": "single"},
        "runtime": {"device": "cpu", "threads": 1},
        "output": {"dir": out},
    }


@pytest.fixture(scope="module")
def users_model(tmp_path_factory) -> str:
    """The documented example, copied to a directory that is not the repository."""
    home = tmp_path_factory.mktemp("user_project")
    shutil.copy(ROOT / "examples/my_kan.py", home / "their_kan.py")
    return f"{home / 'their_kan.py'}:build"


@pytest.mark.parametrize(
    "strategy",
    [{"name": "ddp"}, {"name": "fsdp2"}, {"name": "deepspeed", "zero_stage": 3}],
    ids=["ddp", "fsdp2", "zero3"],
)
@pytest.mark.slow  # the slow tier (make test-slow)
def test_a_model_from_a_users_file_trains_with_parity_under_every_kind_of_strategy(users_model, tmp_path, strategy):
    out = str(tmp_path / "runs")
    expected = [s.loss for s in run_here(experiment(users_model, out)).combined]
    result = run_jobs([{"id": "run", "config": experiment(users_model, out, strategy)}], tmp_path)["run"]
    assert result["status"] == "ok"
    assert max_rel_diff(result["losses"], expected, STEPS) < 1e-5
    assert expected[-1] < expected[0]  # it trained


def test_the_record_says_custom_with_its_factory_options_and_size(users_model, tmp_path):
    record = Trainer(parse_experiment(experiment(users_model, str(tmp_path))), DistEnv(), show_progress=False).run()
    assert record.model.family == "custom" and record.model.options["factory"] == users_model
    assert record.model.options["options"] == {"hidden": [16], "grid": 4}
    assert record.model.params_trainable == 64 * 16 * (1 + 7) + 16 * 10 * (1 + 7)  # base + grid + order bases per edge


@pytest.mark.parametrize(
    "factory,message",
    [
        ("my_kan.build", "is not 'package.module:function' or 'path/to/file.py:function'"),
        ("no_such_package_x.models:build", "cannot import no_such_package_x.models (ModuleNotFoundError"),
        ("missing/file.py:build", "cannot import missing/file.py (OSError: no file missing/file.py"),
        ("examples/my_kan.py:make", "examples/my_kan.py has no function 'make' (it has build)"),
        ("torch.nn.functional:relu", None),  # importable, but fails with these options: refused when built
        ("builtins:dict", None),  # importable and callable, but returns no module
    ],
)
def test_a_bad_factory_is_refused_before_launch(factory, message, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    if message is None:
        cfg = parse_experiment(experiment(factory, str(tmp_path)))
        expected = (
            "returned a dict, not a torch.nn.Module"
            if "dict" in factory
            else "torch.nn.functional:relu(**model.options) failed: TypeError: relu() got an unexpected keyword"
        )
        with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
            cfg.model.build()
        with pytest.raises(
            ConfigError, match=re.escape("model.factory")
        ):  # and before launch, when its size is checked
            cfg.model.parameter_count()
        return
    with pytest.raises(ConfigError, match=re.escape("model.factory")) as err:
        parse_experiment(experiment(factory, str(tmp_path)))
    assert message in str(err.value)


@pytest.mark.parametrize(
    "body, message",
    [
        ("raise RuntimeError('no GPU here')", "cannot import {file} (RuntimeError: no GPU here)"),
        ("import json\nCONFIG = json.loads('{')", "cannot import {file} (JSONDecodeError: Expecting property name"),
        ("WIDTH = {}['width']", "cannot import {file} (KeyError: 'width')"),
        ("import sys\nsys.exit(3)", "importing {file} called sys.exit(3); run the script's own code only under"),
        ("raise SystemExit", "importing {file} called sys.exit(None)"),
    ],
    ids=["runtime_error", "json_error", "key_error", "sys_exit", "bare_exit"],
)
def test_a_factory_module_that_fails_on_import_is_one_line_and_exit_2(body, message, tmp_path):
    """As a user meets it: ``kanscale train`` ends before launch naming the file, with one
    ``model.factory:`` line that says what the import raised, and no traceback."""
    module = tmp_path / "broken_kan.py"
    module.write_text(f"{body}\n\ndef build(**options):\n    return None\n")
    config = tmp_path / "custom.yaml"
    config.write_text(json.dumps(experiment(f"{module}:build", str(tmp_path / "runs"))))
    proc = subprocess.run(
        [sys.executable, "-m", "launchers.cli", "train", str(config)],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert lines[0] == f"kanscale: error: {config} is invalid:" and len(lines) == 2, proc.stderr
    assert lines[1].startswith("  - model.factory: ") and message.format(file=module) in lines[1], proc.stderr
    assert not (tmp_path / "runs").exists()  # refused before anything ran


WIDTHS = """
from torch import nn


def stack(widths, bias=True):  # names widths: kanscale passes model.widths
    return nn.Sequential(*(nn.Linear(a, b, bias=bias) for a, b in zip(widths, widths[1:])))


def keyword_only(*, widths):
    return stack(widths)


def forwards_its_keywords(**options):  # **kwargs alone: not given widths, which nn.Linear would refuse
    return nn.Linear(64, 10, **options)
"""


@pytest.mark.parametrize(
    "function, widths", [("stack", [64, 32, 10]), ("keyword_only", [64, 10]), ("forwards_its_keywords", [64, 10])]
)
def test_a_factory_that_names_widths_is_given_model_widths(tmp_path, function, widths):
    module = tmp_path / "widths_kan.py"
    module.write_text(WIDTHS)
    config = experiment(f"{module}:{function}", str(tmp_path / "runs"))
    config["model"].update(widths=widths, options={"bias": False} if function != "keyword_only" else {})
    cfg = parse_experiment(config)
    preflight(cfg, "cpu", 1)  # the model it builds maps the task's 64 inputs to its 10 classes
    linears = [m for m in cfg.model.build().modules() if isinstance(m, nn.Linear)]
    assert [linears[0].in_features, *(m.out_features for m in linears)] == widths
    assert all(m.bias is None for m in linears) == (function != "keyword_only")  # and options still reach it


def test_widths_in_the_options_of_a_factory_that_is_given_them_are_refused_and_the_fix_works(tmp_path):
    module = tmp_path / "widths_kan.py"
    module.write_text(WIDTHS)
    config = experiment(f"{module}:stack", str(tmp_path / "runs"))
    config["model"]["options"] = {"widths": [64, 10]}
    with pytest.raises(ConfigError) as refused:
        parse_experiment(config)
    line = str(refused.value).splitlines()[1]
    assert line == (
        f"  - model.options: {module}:stack is given model.widths as its widths; leave widths out of "
        "model.options (set model.widths)"
    )
    del config["model"]["options"]["widths"]  # the fix the message gives
    assert isinstance(parse_experiment(config).model.build(), nn.Sequential)


def test_a_misspelled_factory_names_its_field_once_and_its_suggestion_trains(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    from launchers.cli import main

    config = experiment("examples/my_kan.py:buld", str(tmp_path / "runs"))
    config["training"].update(steps=4, warmup_steps=1)
    path = tmp_path / "custom.yaml"
    path.write_text(json.dumps(config))
    assert main(["train", str(path), "--no-progress"]) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "buld" in line]
    assert line.count("model.factory") == 1, line
    assert line.startswith(
        "  - model.factory: examples/my_kan.py has no function 'buld' (it has build); "
        "did you mean 'examples/my_kan.py:build'?"
    ), line
    with pytest.raises(ValueError) as from_python:  # the validator's own message, as the Python API shows it
        parse_model_config(config["model"])
    assert "model.factory" not in str(from_python.value) and "has no function 'buld'" in str(from_python.value)
    config["model"]["factory"] = line.split("did you mean '")[1].split("'")[0]  # the fix the message gives
    path.write_text(json.dumps(config))
    assert main(["train", str(path), "--no-progress"]) == 0
    (record,) = (tmp_path / "runs").glob("*/summary.json")
    assert json.loads(record.read_text())["status"] == "ok"


SHAPED = """
import torch
from torch import nn


class ValueDependent(nn.Module):  # reads a value in forward, which meta tensors do not have
    def __init__(self, inputs, outputs):
        super().__init__()
        self.linear = nn.Linear(inputs, outputs)

    def forward(self, x):
        return self.linear(x) * (1.0 if float(x.abs().sum()) >= 0 else 2.0)


def linear(inputs=64, outputs=10, value_dependent=False):
    return ValueDependent(inputs, outputs) if value_dependent else nn.Linear(inputs, outputs)
"""


@pytest.mark.parametrize(
    "options, message",
    [
        (
            {"outputs": 3},
            "gives an output of shape [2, 3] for 2 samples, but model.widths ends with 10 and task sklearn "
            "has 10 outputs, so [2, 10] was expected; make the factory's model output 10 values per sample",
        ),
        ({"outputs": 3, "value_dependent": True}, "gives an output of shape [2, 3] for 2 samples"),
        ({"inputs": 5}, "builds a model that does not take task sklearn's 64 inputs (model.widths[0]): RuntimeError"),
        ({}, None),
        ({"value_dependent": True}, None),
    ],
    ids=["too_few_logits", "too_few_on_cpu", "wrong_inputs", "right", "right_on_cpu"],
)
def test_the_model_a_factory_builds_is_checked_against_the_task_before_launch(tmp_path, options, message):
    module = tmp_path / "shaped.py"
    module.write_text(SHAPED)
    config = experiment(f"{module}:linear", str(tmp_path / "runs"))
    config["model"]["options"] = options
    cfg = parse_experiment(config)
    if message is None:
        preflight(cfg, "cpu", 1)
        return
    with pytest.raises(ConfigError) as refused:
        preflight(cfg, "cpu", 1)
    assert str(refused.value).startswith(f"model.factory: {module}:linear builds a model that ")
    assert message in str(refused.value)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)

    def forward(self, x):
        return self.inner(x)


def test_the_wrap_policy_picks_units_by_class_or_by_size():
    model = nn.Sequential(nn.Linear(4, 64), nn.ModuleList([Block(64), Block(64)]), nn.ReLU(), nn.Linear(64, 1))
    default = wrap_units(model)
    assert [type(u).__name__ for u in default] == ["Linear", "Block", "Block", "Linear"]  # containers are looked into
    assert [type(u).__name__ for u in wrap_units(model, WrapPolicy(classes=["Block"]))] == ["Block", "Block"]
    assert [type(u).__name__ for u in wrap_units(model, WrapPolicy(min_params=1000))] == ["Block", "Block"]
    cfg = parse_experiment(
        {"name": "z", "model": {"family": "bspline", "widths": [2, 8, 1]}, "task": {"name": "quadratic"}}
    )
    zoo = cfg.model.build()
    assert wrap_units(zoo) == zoo.blocks  # the zoo's own units: one per KAN layer
    assert wrap_units(zoo, WrapPolicy(min_params=10**9)) == []  # a policy given overrides them


def test_fsdp2_shards_a_longer_dimension_only_where_the_ranks_divide_it():
    from strategies.backends.fsdp2 import shard_largest_dim

    assert shard_largest_dim(nn.Parameter(torch.zeros(1, 64, 8)), world_size=2).dim == 1  # a KAN output layer
    assert shard_largest_dim(nn.Parameter(torch.zeros(1, 293)), world_size=2).dim == 0  # uneven: dim 0, as FSDP2 allows


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
