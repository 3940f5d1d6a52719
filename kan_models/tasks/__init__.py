"""Tasks: what a model learns and how it is scored (the contract: kan_models/tasks/contract.py).
A new task is one class and one line in TASKS."""

from typing import TYPE_CHECKING

from kan_models.base import one_of
from kan_models.tasks.bundled import SklearnTask
from kan_models.tasks.contract import OBJECTIVES, Objective, TaskConfig, TaskData
from kan_models.tasks.files import FileTask
from kan_models.tasks.synthetic import ExpSinTask, FeynmanTask, HighDimTask, QuadraticTask

TASKS: dict[str, type[TaskConfig]] = {
    "quadratic": QuadraticTask,
    "exp_sin": ExpSinTask,
    "high_dim": HighDimTask,
    "feynman": FeynmanTask,
    "file": FileTask,
    "sklearn": SklearnTask,
}

if TYPE_CHECKING:
    AnyTaskConfig = TaskConfig
else:
    AnyTaskConfig = one_of(TASKS.values(), "name")

__all__ = ["OBJECTIVES", "TASKS", "AnyTaskConfig", "Objective", "TaskConfig", "TaskData"]
