"""Native DeepSpeed JSON as DeepSpeed's and Accelerate's templates ship it ("auto" everywhere),
on both routes to DeepSpeed: ``strategy.config`` / ``--deepspeed-config`` and an accelerate
launch config's ``deepspeed_config_file``; an NVMe offload without a path, or without DeepSpeed's
async_io op, refused before launch. The templates are copies in tests/data/native/."""

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DeepSpeedPlugin
from accelerate.utils.launch import prepare_deepspeed_cmd_env

from analysis.records.run_files import read_summary
from kan_models import build_model
from kanscale.errors import ConfigError
from launchers.cli import main
from strategies.backends.accelerate_launch import launch_config_conflicts
from strategies.backends.deepspeed_config import UncheckedDeepSpeedKeys, auto_paths, resolve_native
from strategies.experiment import load_experiment, parse_experiment
from strategies.lifecycle.preflight import preflight
from strategies.step.precision_support import cpu_fp16_supported
from tests.helpers.cli import refused
from tests.helpers.launch import ROOT, run

NATIVE = ROOT / "tests/data/native"
ACCELERATE_YAML = NATIVE / "accelerate_zero3_offload_auto.yaml"


def with_native(name: str, *overrides: str):
    return load_experiment("quickstart", ["strategy.name=deepspeed", f"strategy.config={NATIVE / name}", *overrides])


# ------------------------------------------------------------------------ "auto" resolved


@pytest.mark.parametrize("widths,hidden", [([2, 16, 1], 16), ([2, 64, 40, 1], 64)])
def test_auto_gets_accelerates_numbers_for_the_experiments_model(widths, hidden):
    cfg = with_native("zero3_offload_auto.json", f"model.widths={widths}")
    resolved = cfg.strategy.resolve(cfg.training, world_size=2)
    zero = resolved["zero_optimization"]
    assert (
        zero["reduce_bucket_size"],
        zero["stage3_prefetch_bucket_size"],
        zero["stage3_param_persistence_threshold"],
    ) == (hidden * hidden, int(0.9 * hidden * hidden), 10 * hidden)
    assert zero["stage3_gather_16bit_weights_on_model_save"] is False
    assert (
        resolved["train_micro_batch_size_per_gpu"],
        resolved["gradient_accumulation_steps"],
        resolved["train_batch_size"],
        resolved["gradient_clipping"],
    ) == (256, 1, 512, 0.0)
    assert resolved["fp16"]["enabled"] is False and resolved["bf16"]["enabled"] is False
    assert auto_paths(resolved) == []  # nothing reaches DeepSpeed as "auto"
    # the options the record stores say the same numbers
    assert (cfg.strategy.reduce_bucket_size, cfg.strategy.param_persistence_threshold) == (hidden * hidden, 10 * hidden)


def test_a_strategy_option_given_explicitly_wins_over_auto():
    cfg = with_native("zero3_offload_auto.json", "strategy.param_persistence_threshold=0")
    assert cfg.strategy.resolve(cfg.training, 2)["zero_optimization"]["stage3_param_persistence_threshold"] == 0


def test_the_dry_run_prints_the_resolved_config(capsys):
    assert (
        main(
            [
                "run",
                "quickstart",
                "--deepspeed-config",
                str(NATIVE / "zero2_auto.json"),
                "--launcher",
                "deepspeed",
                "--nproc-per-node",
                "2",
                "--dry-run",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert '"reduce_bucket_size": 256' in out and '"train_micro_batch_size_per_gpu": 256' in out
    assert '"auto"' not in out


def test_an_auto_the_suite_cannot_fill_is_refused_naming_the_key():
    cfg = with_native("zero3_sub_group_auto.json")
    with pytest.raises(
        ConfigError, match=re.escape('cannot fill "auto" for zero_optimization.sub_group_size; give a value in')
    ):
        preflight(cfg, "cpu", 2)
    settings = yaml.safe_load(ACCELERATE_YAML.read_text())
    settings["deepspeed_config"]["deepspeed_config_file"] = str(NATIVE / "zero3_sub_group_auto.json")
    problems = launch_config_conflicts(settings, cfg.training, "cpu", 2, model=cfg.model)
    assert len(problems) == 1 and 'cannot fill "auto" for zero_optimization.sub_group_size' in problems[0]


# ------------------------------------------------------------------------ unknown keys


def test_unknown_keys_are_named_in_one_warning():
    cfg = with_native("zero2_unknown_keys.json")
    with pytest.warns(UncheckedDeepSpeedKeys) as caught:
        preflight(cfg, "cpu", 2)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert (
        "communication_data_type, prescale_gradients, zero_optimization.zero_quantized_nontrainable_weights" in message
    )
    assert "passed to DeepSpeed unchecked" in message


def test_only_rank_zero_repeats_the_warning(monkeypatch):
    cfg = with_native("zero2_unknown_keys.json")
    monkeypatch.setenv("RANK", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncheckedDeepSpeedKeys)
        preflight(cfg, "cpu", 2)


@pytest.mark.parametrize(
    "path",
    [
        *sorted((ROOT / "configs/deepspeed").glob("*.json")),
        NATIVE / "zero2_auto.json",
        NATIVE / "zero3_offload_auto.json",
    ],
)
def test_the_shipped_configs_and_the_upstream_templates_warn_about_nothing(path):
    # the examples' shape differs from the experiment by design: it runs with the line it is shown with
    decides = ["strategy.decides=file"] if path.name == "examples_style.json" else []
    cfg = load_experiment("quickstart", ["strategy.name=deepspeed", f"strategy.config={path}", *decides])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncheckedDeepSpeedKeys)
        preflight(cfg, "cpu", 2)


# ------------------------------------------------------------------------ the Accelerate route


def accelerate_yaml(tmp_path: Path, native: str | None = None, **settings) -> Path:
    """The template accelerate launch config, pointing at ``native`` (a path as written in it)."""
    data = yaml.safe_load(ACCELERATE_YAML.read_text())
    if native is not None:
        data["deepspeed_config"]["deepspeed_config_file"] = native
    data.update(settings)
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def dry_run_accelerate(config: Path) -> int:
    return main(
        [
            "run",
            "quickstart",
            "--strategy",
            "accelerate",
            "--launcher",
            "accelerate",
            "--accelerate-config",
            str(config),
            "--nproc-per-node",
            "2",
            "--dry-run",
        ]
    )


@pytest.mark.parametrize(
    "native,settings,advice",
    [
        # quickstart sets optimizer adam; the file's AdamW contradicts it, and the advice names both ways out
        (
            "tests/data/native/zero2_optimizer.json",
            {},
            [
                'optimizer.type is "AdamW", but the experiment sets training.optimizer to adam',
                "to train with the file's values: --set training.optimizer=adamw",
            ],
        ),
        # the file's fp16 is the run's where the experiment sets no precision: refused here for this CPU only
        (
            "tests/data/native/zero2_fp16.json",
            {},
            ["training.precision: fp16 under Accelerate's DeepSpeed plugin cannot run on this cpu machine"]
            if not cpu_fp16_supported()
            else [],
        ),
        (
            None,
            {"mixed_precision": "no"},
            ["remove mixed_precision: Accelerate refuses it beside deepspeed_config.deepspeed_config_file"],
        ),
    ],
)
def test_the_accelerate_route_refuses_before_launch_with_advice_that_works(
    tmp_path, monkeypatch, capsys, native, settings, advice
):
    monkeypatch.chdir(ROOT)  # the JSON's path is relative to where accelerate launch (and kanscale run) starts
    assert dry_run_accelerate(accelerate_yaml(tmp_path, native, **settings)) == (2 if advice else 0)
    error = capsys.readouterr().err
    assert all(line in error for line in advice), error


def test_a_missing_relative_deepspeed_file_is_named_with_where_it_is_looked_up(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # started from another directory: the template's relative path is not there
    assert dry_run_accelerate(ACCELERATE_YAML) == 2
    assert (
        f"deepspeed_config.deepspeed_config_file: tests/data/native/zero3_offload_auto.json does not exist in "
        f"{tmp_path}, the directory accelerate launch reads it from"
    ) in capsys.readouterr().err


def test_the_template_passes_and_accelerate_agrees_about_mixed_precision(tmp_path, monkeypatch):
    """The launch config the advice leads to is one Accelerate's own checks accept, and the one
    with mixed_precision beside the file is one they refuse (after launch, where they run)."""
    monkeypatch.chdir(ROOT)
    assert dry_run_accelerate(ACCELERATE_YAML) == 0

    def plugin_from(config: Path) -> DeepSpeedPlugin:
        args = launch_command_parser().parse_args(["--config_file", str(config), "train.py"])
        args, defaults, mixed_precision_from_file = _validate_launch_command(args)
        # what accelerate's launch_command hands the ranks
        fields = [*defaults.deepspeed_config, *(["mixed_precision"] if mixed_precision_from_file else [])]
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        for key, value in prepare_deepspeed_cmd_env(args)[1].items():
            monkeypatch.setenv(key, value)
        return DeepSpeedPlugin()

    with pytest.raises(ValueError, match="When using `deepspeed_config_file`"):
        plugin_from(accelerate_yaml(tmp_path, mixed_precision="no"))
    cfg = load_experiment("quickstart", ["strategy.name=accelerate"])
    plugin = plugin_from(ACCELERATE_YAML)
    resolution = resolve_native(plugin.deepspeed_config, cfg.training, 2, 16, "plugin")
    assert resolution.problems == [] and auto_paths(resolution.config) == []


# ------------------------------------------------------------------------ a real 2-rank run


def experiment(strategy: dict, out: Path) -> dict:
    return {
        "name": "native",
        "model": {"family": "bspline", "widths": [2, 16, 1], "grid": 5, "k": 3, "grid_range": [-2, 2]},
        "task": {"name": "quadratic", "n_train": 2048, "n_test": 128},
        "training": {"seed": 0, "micro_batch": 64, "steps": 4, "warmup_steps": 1},
        "strategy": strategy,
        "measurement": {"baseline_steps": 2},
        "runtime": {"device": "cpu", "threads": 1},
        "output": {"dir": str(out)},
    }


@pytest.mark.slow  # the slow tier (make test-slow)
def test_zero3_offload_with_the_auto_template_shards_on_both_routes(tmp_path):
    """One accelerate launch of 2 gloo ranks trains three jobs: the shipped zero3.json (persistence
    threshold 0: every parameter sharded), the auto template on the direct route and through
    Accelerate's DeepSpeed plugin (threshold 10 x 16: the parameters of at most 160 elements stay
    whole, the rest sharded, as under Accelerate)."""
    jobs = [
        {
            "id": "shipped",
            "config": experiment({"name": "deepspeed", "config": "configs/deepspeed/zero3.json"}, tmp_path / "runs"),
        },
        {
            "id": "direct",
            "config": experiment(
                {"name": "deepspeed", "config": str(NATIVE / "zero3_offload_auto.json")}, tmp_path / "runs"
            ),
        },
        {"id": "accelerate", "config": experiment({"name": "accelerate"}, tmp_path / "runs")},
    ]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(ACCELERATE_YAML),
            str(ROOT / "tests/helpers/dist_worker.py"),
            str(tmp_path / "jobs.json"),
            str(tmp_path / "results.json"),
        ],
        DS_ACCELERATOR="cpu",
    )
    results = json.loads((tmp_path / "results.json").read_text())
    assert [results[job]["distributed_type"] for job in ("shipped", "direct", "accelerate")] == [
        "DEEPSPEED_ZERO3",
        "DEEPSPEED_ZERO3",
        "DEEPSPEED",
    ]
    params = {job: results[job]["model_state"]["params"] for job in results}
    model = build_model(parse_experiment(jobs[0]["config"]).model, seed=0)
    total = sum(p.numel() for p in model.parameters())
    whole = sum(p.numel() for p in model.parameters() if p.numel() <= 160)
    assert params["shipped"] == 4 * total // 2  # half of every fp32 parameter per rank
    # a persistent parameter is held whole besides its partition; unsharded, every one would be
    assert params["direct"] == params["accelerate"] == params["shipped"] + 4 * whole < params["shipped"] + 4 * total
    for job in ("direct", "accelerate"):
        zero = read_summary(Path(results[job]["run_dir"])).strategy.backend_config["zero_optimization"]
        assert (
            zero["reduce_bucket_size"],
            zero["stage3_prefetch_bucket_size"],
            zero["stage3_param_persistence_threshold"],
        ) == (256, 230, 160), job
        assert zero["offload_param"]["device"] == "cpu" and results[job]["status"] == "ok"


def test_nvme_offload_without_a_path_or_the_async_io_op_is_refused_before_launch(tmp_path, capsys):
    pytest.importorskip("deepspeed")
    from strategies.backends.deepspeed import accelerator_env

    # whether this machine has the op, asked of DeepSpeed itself meanwhile (importing it is slow)
    probe = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from deepspeed.ops.op_builder import AsyncIOBuilder; "
            "sys.exit(0 if AsyncIOBuilder().is_compatible(verbose=False) else 3)",
        ],
        env={**os.environ, **accelerator_env("cuda" if torch.cuda.is_available() else "cpu")},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    native = tmp_path / "ds_nvme.json"
    offload = {"stage": 3, "offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "nvme"}}
    native.write_text(json.dumps({"zero_optimization": offload}))
    run = [
        "run",
        "quickstart",
        "--deepspeed-config",
        str(native),
        "--launcher",
        "deepspeed",
        "--nproc-per-node",
        "2",
        "--dry-run",
    ]
    err = refused(run, capsys)
    for block in ("offload_optimizer", "offload_param"):
        assert (
            f'zero_optimization.{block}.device is "nvme" but zero_optimization.{block}.nvme_path is not set' in err
            and f"give zero_optimization.{block}.nvme_path, a directory on a local NVMe drive" in err
        )
    for block in ("offload_optimizer", "offload_param"):
        offload[block]["nvme_path"] = str(tmp_path / "swap")
    native.write_text(json.dumps({"zero_optimization": offload}))
    if probe.wait(timeout=300) == 0:  # this machine has libaio: the config is accepted
        assert main(run) == 0
    else:
        err = refused(run, capsys)
        assert "DeepSpeed's async_io op, which swaps to NVMe, is not available on this machine" in err
        assert "zero_optimization.offload_optimizer.device and zero_optimization.offload_param.device" in err
