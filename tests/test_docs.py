"""The configuration reference names every field a config may hold."""

from pathlib import Path

from kan_models import FAMILIES, TASKS
from kan_models.base import WrapPolicy
from kan_models.custom import CustomConfig
from strategies.experiment import ExperimentConfig
from strategies.registry import STRATEGIES
from strategies.sections import OutputConfig, RuntimeConfig, TrainingConfig

DOC = (Path(__file__).resolve().parents[1] / "docs/configuration.md").read_text()


def test_every_config_field_is_documented():
    classes = [
        ExperimentConfig,
        TrainingConfig,
        RuntimeConfig,
        OutputConfig,
        *FAMILIES.values(),
        CustomConfig,
        WrapPolicy,
        *TASKS.values(),
        *STRATEGIES.values(),
    ]
    missing = sorted(
        {
            f"{cls.__name__}.{name}"
            for cls in classes
            for name in cls.model_fields
            if f"`{name}`" not in DOC and f"`wrap.{name}`" not in DOC
        }
    )
    assert not missing, f"add to docs/configuration.md: {missing}"
    for name in [*FAMILIES, *TASKS, *STRATEGIES]:
        assert f"`{name}`" in DOC, name
