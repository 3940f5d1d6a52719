"""WHAT is trained: the KAN model zoo, its registry, and the synthetic tasks."""

from kan_models.base import LayerStack, ModelConfig, ParamCount, count_parameters
from kan_models.registry import FAMILIES, AnyModelConfig, build_model, parse_model_config
from kan_models.tasks import TASKS, AnyTaskConfig, TaskConfig, TaskData

__all__ = [
    "FAMILIES",
    "TASKS",
    "AnyModelConfig",
    "AnyTaskConfig",
    "LayerStack",
    "ModelConfig",
    "ParamCount",
    "TaskConfig",
    "TaskData",
    "build_model",
    "count_parameters",
    "parse_model_config",
]
