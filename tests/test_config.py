"""Experiment configs: the shipped files validate, overrides work, bad input is named: a boolean
where a number goes, a seed numpy or torch refuses, a timeout too short to form a process group,
one test sample."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from kan_models import parse_model_config
from kanscale.errors import ConfigError
from launchers.studies.study import load_study
from strategies.experiment import load_experiment, parse_experiment

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs/experiments/quickstart.yaml"


@pytest.mark.parametrize("path", sorted((ROOT / "configs/experiments").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_experiments_validate(path):
    cfg = load_experiment(path)
    assert cfg.model.widths[0] == cfg.task.input_dim


def test_paper_config_is_the_published_setup():
    cfg = load_experiment(ROOT / "configs/experiments/paper_kan64.yaml")
    assert (cfg.model.family, cfg.model.widths, cfg.model.grid, cfg.model.k, cfg.model.seed) == (
        "pykan",
        [2, 64, 1],
        10,
        3,
        42,
    )
    assert (cfg.training.micro_batch, cfg.training.lr, cfg.training.epochs, cfg.task.n_train) == (
        512,
        1e-3,
        40,
        100_000,
    )
    assert cfg.task.noise_std == 0.01 and cfg.task.x_range == (-2.0, 2.0)


def test_overrides_are_parsed_as_yaml_values():
    cfg = load_experiment(
        QUICKSTART, ["training.lr=1e-2", "model.widths=[2, 7, 1]", "runtime.threads=null", "training.steps=12"]
    )
    assert cfg.training.lr == 0.01 and cfg.model.widths == [2, 7, 1] and cfg.runtime.threads is None
    assert cfg.training.steps == 12


def test_defaults_are_explicit_in_the_resolved_config():
    cfg = parse_experiment(
        {"name": "x", "model": {"family": "rbf", "widths": [2, 3, 1]}, "task": {"name": "quadratic"}}
    )
    resolved = cfg.resolved()
    assert resolved["training"]["grad_clip"] == 0.0  # gradient clipping is off unless asked for
    assert resolved["strategy"] == {"name": "single"}
    assert resolved["model"]["grid"] == 8
    assert parse_experiment(yaml.safe_load(yaml.safe_dump(resolved))).digest() == cfg.digest()


def test_digest_changes_with_any_hyperparameter():
    a = load_experiment(QUICKSTART)
    b = load_experiment(QUICKSTART, ["training.eps=1e-7"])
    assert a.digest() != b.digest()


BAD = [
    # (override or raw edit, text that must appear in the message)
    (["training.lrr=0.1"], "training.lrr: unknown key; did you mean 'lr'"),
    (["training.lr=-1"], "training.lr: Input should be greater than 0"),
    (["training.lr=fast"], "training.lr: Input should be a valid number"),
    (["model.family=bsplin"], "model.family: 'bsplin' is not one of"),
    (["model.grid=0"], "model.grid: Input should be greater than or equal to 1"),
    (["model.k=9"], "model.k: Input should be less than or equal to 5"),
    (["model.gridd=3"], "model.gridd: unknown key; did you mean 'grid'"),
    (["model.widths=[2]"], "model.widths: needs at least an input and an output width, e.g. [2, 64, 1] (given: [2])"),
    (["model.widths=[2,-4,1]"], "model.widths"),
    (["model.widths=[3,4,1]"], "model.widths starts with 3 inputs but task quadratic has 2"),
    (["model.grid_range=[1,-1]"], "model.grid_range: must be [low, high] with low < high"),
    (["training.micro_batch=0"], "training.micro_batch: Input should be greater than or equal to 1"),
    (["training.micro_batch=abc"], "training.micro_batch: Input should be a valid integer"),
    (["training.grad_accum=-2"], "training.grad_accum"),
    (["training.optimizer=lion"], "training.optimizer: Input should be 'adam', 'adamw' or 'sgd'"),
    (["training.epochs=null"], "set either epochs or steps"),
    (["training.betas=[0.9,1.5]"], "betas must each lie in [0, 1)"),
    (["training.dtype=float16"], "training.dtype"),
    (["task.name=nope"], "task.name: 'nope' is not one of"),
    (["task.n_train=0"], "task.n_train"),
    (["strategy.name=zero4"], "strategy.name: 'zero4' is not one of"),
    (["runtime.device=tpu"], "runtime.device"),
    (["foo.bar=1"], "foo: unknown key; allowed keys here: name"),
    (["name=has space"], "name: String should match pattern"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[b[0][0] for b in BAD])
def test_bad_config_is_rejected_naming_the_field(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_experiment(QUICKSTART, overrides)
    assert message in str(err.value)


def test_missing_sections_and_files(tmp_path):
    with pytest.raises(ConfigError, match="model: required field is missing"):
        parse_experiment({"name": "x", "task": {"name": "quadratic"}})
    with pytest.raises(ConfigError, match="model: missing 'family'"):
        parse_experiment({"name": "x", "model": {"widths": [2, 1]}, "task": {"name": "quadratic"}})
    with pytest.raises(ConfigError, match="does not exist"):
        load_experiment(tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: x\nmodel: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_experiment(broken)
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_experiment(listing)


def test_malformed_override():
    with pytest.raises(ConfigError, match=re.escape("expected key.path=value")):
        load_experiment(QUICKSTART, ["training.lr"])
    with pytest.raises(ConfigError, match=re.escape("training.lr is not a section")):
        load_experiment(QUICKSTART, ["training.lr.x=1"])


def test_a_model_wrong_at_both_ends_is_told_both_and_the_fix_given_trains(tmp_path):
    """Both ends of model.widths in one message (a new file's user once needed two runs), and the
    --set line it gives, followed, validates."""
    with pytest.raises(ConfigError) as err:
        load_experiment(ROOT / "configs/experiments/quickstart.yaml", ["model.widths=[3,16,4]"])
    message = str(err.value)
    assert "starts with 3 inputs but task quadratic has 2" in message and "ends with 4 outputs" in message
    fix = re.search(r"set (model\.widths=\[[\d,]+\])", message).group(1)
    assert load_experiment(ROOT / "configs/experiments/quickstart.yaml", [fix]).model.widths == [2, 16, 1]


def refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_experiment("quickstart", list(overrides))
    return str(err.value)


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


def test_a_timeout_too_short_to_form_a_process_group_is_refused():
    assert "runtime.timeout_s: Input should be greater than or equal to 1" in refused("runtime.timeout_s=0.001")
    assert load_experiment("quickstart", ["runtime.timeout_s=1"]).runtime.timeout_s == 1.0


def test_one_test_sample_is_refused():
    assert "task.n_test: Input should be greater than or equal to 2" in refused("task.n_test=1")
