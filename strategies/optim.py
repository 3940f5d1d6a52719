"""The optimizer every strategy uses, built from the experiment's hyperparameters only."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from strategies.sections import TrainingConfig


def build_optimizer(params: Iterable[torch.nn.Parameter], training: TrainingConfig) -> torch.optim.Optimizer:
    t = training
    if t.optimizer == "adam":
        return torch.optim.Adam(params, lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay)
    if t.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay)
    return torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
