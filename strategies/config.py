"""The experiment's sections that belong to training itself: hyperparameters, runtime and
output. :mod:`strategies.experiment` assembles them with the model, task and strategy."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ConfigError(ValueError):
    """A config the suite refuses, with a message meant for the user (no traceback needed)."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TrainingConfig(Section):
    """Every hyperparameter, passed explicitly to whichever backend trains the model."""

    seed: int = Field(0, description="seeds the data, the initial weights and the data order")
    optimizer: Literal["adam", "adamw", "sgd"] = "adam"
    lr: float = Field(1e-3, gt=0.0)
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam/AdamW betas")
    eps: float = Field(1e-8, gt=0.0, description="Adam/AdamW epsilon")
    weight_decay: float = Field(0.0, ge=0.0)
    momentum: float = Field(0.0, ge=0.0, lt=1.0, description="SGD momentum")
    grad_clip: float = Field(0.0, ge=0.0, description="max global gradient norm; 0 = off")
    micro_batch: int = Field(512, ge=1, description="samples per rank per forward/backward")
    grad_accum: int = Field(1, ge=1, description="micro-batches accumulated per optimizer step")
    epochs: float | None = Field(1, gt=0.0, description="passes over the training set (or set steps)")
    steps: int | None = Field(None, ge=1, description="optimizer steps; overrides epochs when set")
    warmup_steps: int = Field(5, ge=0, description="first steps excluded from timing")
    dtype: Literal["float32", "float64"] = "float32"
    grid_update_every: int = Field(0, ge=0, description="refit spline grids every N steps; 0 = never")
    grid_update_until: int | None = Field(None, ge=1, description="last step at which grids are refitted")
    log_every: int = Field(0, ge=0, description="steps between log lines when not on a terminal; 0 = about 10 lines")

    @model_validator(mode="after")
    def _valid_combination(self) -> "TrainingConfig":
        for beta in self.betas:
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"betas must each lie in [0, 1), got {list(self.betas)}")
        if self.epochs is None and self.steps is None:
            raise ValueError("set either epochs or steps")
        return self


class RuntimeConfig(Section):
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available")
    threads: int | None = Field(None, ge=1, description="torch intra-op threads per rank; default: torch's")


class OutputConfig(Section):
    dir: str = Field("runs", description="run records go to DIR/<run_id>/")
