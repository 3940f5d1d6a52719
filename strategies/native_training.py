"""An experiment as it trains: its training section with what the strategy's native file (a
DeepSpeed JSON's optimizer, scheduler, fp16/bf16 blocks) decides of it where the experiment left
it open. Every path to a run takes it from here once: ``kanscale run`` before launch, and every
rank (``train``, the trainer, finding a run to resume), so that all of them agree on the values,
the experiment's digest and what the record says was adopted."""

from __future__ import annotations

from strategies.experiment import ExperimentConfig


def with_native_training(cfg: ExperimentConfig) -> ExperimentConfig:
    """``cfg`` with :meth:`StrategyConfig.native_training` applied (once: an experiment already
    adopted is returned as it is); a ConfigError names what the file says that cannot run."""
    if cfg.training._adopted is not None:
        return cfg
    return cfg.model_copy(update={"training": cfg.strategy.native_training(cfg.training)})


def adopted_values(cfg: ExperimentConfig) -> dict[str, str] | None:
    """What the native file decided of the training, field -> its file and key; None: nothing."""
    return with_native_training(cfg).training._adopted or None
