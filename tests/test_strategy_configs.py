"""Strategy options and native DeepSpeed files: validated against the experiment before anything
runs, and resolved once. Accelerate's launch configs and plugins are tests/test_accelerate_configs.py."""

import json
import re
from pathlib import Path

import pytest

from kan_models import parse_model_config
from kanscale.errors import ConfigError
from strategies.backends.deepspeed import DeepSpeedConfig
from strategies.experiment import load_experiment
from strategies.lifecycle.preflight import preflight
from strategies.registry import STRATEGIES
from strategies.sections import TrainingConfig

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs/experiments/quickstart.yaml"
ACCELERATE = ROOT / "configs/accelerate"
MODEL = parse_model_config({"family": "bspline", "widths": [2, 16, 1]})


def deepspeed(tmp_path, native: dict | None = None, **options) -> DeepSpeedConfig:
    """The strategy section, resolved for MODEL as the experiment resolves it."""
    if native is not None:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(native))
        options["config"] = str(path)
    return DeepSpeedConfig(name="deepspeed", **options).resolved(MODEL)


# ------------------------------------------------------------------------------- DeepSpeed


def test_the_experiment_fills_every_training_value_explicitly(tmp_path):
    training = TrainingConfig(micro_batch=32, grad_accum=2, grad_clip=0.0)
    resolved = deepspeed(tmp_path, zero_stage=3).resolve(training, world_size=2)
    assert resolved["train_micro_batch_size_per_gpu"] == 32 and resolved["train_batch_size"] == 128
    assert resolved["gradient_accumulation_steps"] == 2
    assert resolved["gradient_clipping"] == 0.0  # DeepSpeed would otherwise default to 1.0
    assert resolved["zero_optimization"]["stage"] == 3
    assert resolved["zero_optimization"]["stage3_param_persistence_threshold"] == 0


@pytest.mark.parametrize(
    "native,message",
    [
        (
            {"gradient_clipping": 1.0},
            "gradient_clipping is 1.0, but the experiment sets training.grad_clip to 0.0",
        ),
        (
            {"train_micro_batch_size_per_gpu": 16},
            "train_micro_batch_size_per_gpu is 16, but the experiment sets training.micro_batch to 512",
        ),
        ({"optimizer": {"type": "Lamb"}}, "optimizer.type is 'Lamb', which the suite does not build"),
        (
            {"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}},
            "optimizer.params.lr is 0.1, but the experiment sets training.lr to 0.001",
        ),
        ({"scheduler": {"type": "OneCycle"}}, "scheduler.type is 'OneCycle'; the suite runs DeepSpeed's WarmupLR"),
        (
            {"bf16": {"enabled": True}},
            'bf16.enabled=true, but training.precision=fp32 implies false: set it to false or "auto" in',
        ),
    ],
)
def test_a_native_file_that_contradicts_the_experiment_is_refused(tmp_path, native, message):
    # the experiment sets what the file contradicts (a field it leaves open is taken from the file)
    training = TrainingConfig(precision="fp32", lr=0.001, optimizer="adamw", micro_batch=512, grad_clip=0.0)
    with pytest.raises(ConfigError, match="cannot run as given") as err:
        deepspeed(tmp_path, native).resolve(training, world_size=2)
    assert message in str(err.value)


def test_a_native_file_that_sets_bf16_runs_when_the_experiment_asks_for_bf16(tmp_path):
    resolved = deepspeed(tmp_path, {"bf16": {"enabled": True}}).resolve(TrainingConfig(precision="bf16"), world_size=2)
    assert resolved["bf16"]["enabled"] is True and resolved["fp16"]["enabled"] is False
    fp16 = deepspeed(tmp_path, {"fp16": {"enabled": "auto"}}).resolve(TrainingConfig(precision="fp16"), world_size=2)
    # DeepSpeed's loss scaling follows torch.amp.GradScaler's schedule, as the other strategies' fp16 does
    assert fp16["fp16"] == {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 16,
        "hysteresis": 1,
        "consecutive_hysteresis": False,
        "loss_scale_window": 2000,
        "min_loss_scale": 1,
    }


def test_the_native_file_decides_what_the_strategy_leaves_at_its_default(tmp_path):
    native = {"zero_optimization": {"stage": 2, "overlap_comm": True}}
    assert deepspeed(tmp_path, native).resolve(TrainingConfig(), 2)["zero_optimization"]["stage"] == 2
    with pytest.raises(ConfigError, match=re.escape("zero_optimization.stage=2 but strategy.zero_stage=3")):
        deepspeed(tmp_path, native, zero_stage=3).resolve(TrainingConfig(), 2)


@pytest.mark.parametrize(
    "options,message",
    [
        ({"offload_optimizer": True}, "strategy.offload_optimizer: optimizer offload needs ZeRO stage 1, 2 or 3"),
        ({"zero_stage": 2, "offload_param": True}, "strategy.offload_param: parameter offload needs ZeRO stage 3"),
    ],
)
def test_offload_without_the_zero_stage_it_needs(tmp_path, options, message):
    with pytest.raises(ConfigError, match=message):
        deepspeed(tmp_path, **options).resolve(TrainingConfig(), 2)


def test_shipped_deepspeed_files_resolve():
    for path in sorted((ROOT / "configs/deepspeed").glob("*.json")):
        stage = json.loads(path.read_text())["zero_optimization"]["stage"]
        resolved = DeepSpeedConfig(name="deepspeed", config=str(path)).resolved(MODEL).resolve(TrainingConfig(), 2)
        assert resolved["zero_optimization"]["stage"] == stage


def test_zero_stage_4_and_unknown_strategy_options():
    with pytest.raises(ConfigError, match=re.escape("strategy.zero_stage")):
        load_experiment(QUICKSTART, ["strategy.name=deepspeed", "strategy.zero_stage=4"])
    with pytest.raises(ConfigError, match=re.escape("strategy.bucket_size: unknown key")):
        load_experiment(QUICKSTART, ["strategy.name=ddp", "strategy.bucket_size=4"])


# ------------------------------------------------------------------------ preflight, presets


@pytest.mark.parametrize(
    "overrides,world,message",
    [
        (["strategy.name=fsdp2", "strategy.cpu_offload=true"], 2, "strategy.cpu_offload: CPUOffloadPolicy"),
        (["strategy.name=fsdp1", "strategy.cpu_offload=true"], 2, "strategy.cpu_offload"),
        (
            ["strategy.name=fsdp1", "strategy.sharding_strategy=HYBRID_SHARD", "strategy.shard_degree=3"],
            4,
            "strategy.shard_degree: 3 ranks per shard group does not divide the world size 4",
        ),
        (
            ["strategy.name=deepspeed", "strategy.zero_stage=3", "strategy.quantized_gradients=true"],
            2,
            "strategy.quantized_gradients: ZeRO++'s quantized collectives run DeepSpeed's CUDA quantizer kernels",
        ),
        (["strategy.name=single"], 2, "strategy.name: single trains in one process but 2 ranks"),
        (
            ["training.micro_batch=null", "training.global_batch=1000", "strategy.name=ddp"],
            3,
            "training.global_batch: 1000 samples cannot be split evenly over grad_accum (1) x data-parallel ranks (3)",
        ),
        (
            ["strategy.name=fsdp2", "measurement.comm_probe=paper"],
            2,
            "measurement.comm_probe: strategy fsdp2 does not support the paper probe",
        ),
    ],
)
def test_preflight_refuses_what_cannot_run_here(overrides, world, message):
    cfg = load_experiment(QUICKSTART, overrides)
    with pytest.raises(ConfigError) as err:
        preflight(cfg, "cpu", world)
    assert message in str(err.value)


def test_a_missing_native_file_is_refused_when_the_experiment_loads():
    with pytest.raises(ConfigError, match=re.escape("strategy.config: DeepSpeed config missing.json does not exist")):
        load_experiment(QUICKSTART, ["strategy.name=deepspeed", "strategy.config=missing.json"])


@pytest.mark.parametrize(
    "preset,stage,offload", [("zero0", 0, False), ("zero2", 2, False), ("zero3", 3, False), ("zero3_offload", 3, True)]
)
def test_the_options_say_what_the_native_file_decides(preset, stage, offload):
    """The zero3 preset names only its DeepSpeed JSON; the experiment still says stage 3."""
    strategy = load_experiment(QUICKSTART, strategy=preset).strategy
    assert (strategy.zero_stage, strategy.offload_optimizer) == (stage, offload)
    assert strategy.resolve(TrainingConfig(), 2)["zero_optimization"]["stage"] == stage


def test_every_strategy_preset_validates_and_passes_preflight_on_cpu():
    presets = sorted((ROOT / "configs/strategies").glob("*.yaml"))
    assert {p.stem for p in presets} >= {
        "single",
        "ddp",
        "fsdp1",
        "fsdp2",
        "zero0",
        "zero1",
        "zero2",
        "zero3",
        "zero3_offload",
        "accelerate",
    }
    for path in presets:
        cfg = load_experiment(QUICKSTART, strategy=path.stem)
        assert cfg.strategy.name in STRATEGIES
        preflight(cfg, "cpu", 1 if cfg.strategy.name == "single" else 2)
    with pytest.raises(ConfigError, match="no preset named 'zero9'; presets: accelerate"):
        load_experiment(QUICKSTART, strategy="zero9")


def test_kanscale_run_loads_the_experiment_once_and_resolves_the_deepspeed_config_once(monkeypatch, tmp_path, capsys):
    """Before launch: one load of the experiment, one read and one resolution of the DeepSpeed JSON,
    however many checks and the dry run's preview ask for it."""
    import strategies.backends.deepspeed as deepspeed
    import strategies.experiment as experiment
    from launchers.cli import main

    counts = {"parse": 0, "resolve": 0, "read": 0}

    def counting(name, function):
        def counted(*args, **kwargs):
            counts[name] += 1
            return function(*args, **kwargs)

        return counted

    monkeypatch.setattr(experiment, "parse_experiment", counting("parse", experiment.parse_experiment))
    monkeypatch.setattr(deepspeed, "resolve_native", counting("resolve", deepspeed.resolve_native))
    monkeypatch.setattr(deepspeed, "read_mapping", counting("read", deepspeed.read_mapping))
    assert (
        main(
            [
                "run",
                "quickstart",
                "--deepspeed-config",
                "configs/deepspeed/zero2.json",
                "--nproc-per-node",
                "2",
                "--out",
                str(tmp_path),
                "--dry-run",
            ]
        )
        == 0
    )
    assert '"stage": 2' in capsys.readouterr().out  # the preview shows the resolved file
    assert counts == {"parse": 1, "resolve": 1, "read": 1}


def test_a_rank_resolves_the_deepspeed_config_once_for_its_checks_and_its_backend(monkeypatch):
    import strategies.backends.deepspeed as deepspeed
    from strategies.experiment import load_experiment
    from strategies.lifecycle.preflight import preflight

    resolutions, resolve = [], deepspeed.resolve_native
    monkeypatch.setattr(deepspeed, "resolve_native", lambda *a: resolutions.append(a) or resolve(*a))
    cfg = load_experiment("quickstart", strategy="zero3")
    preflight(cfg, "cpu", 2)
    first, again = cfg.strategy.resolve(cfg.training, 2), cfg.strategy.resolve(cfg.training, 2)  # as apply() does
    assert len(resolutions) == 1 and first == again and first is not again  # each caller gets its own copy
    assert (
        cfg.strategy.resolve(cfg.training, 4)["train_batch_size"] != first["train_batch_size"] and len(resolutions) == 2
    )
