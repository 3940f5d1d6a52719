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


def launch_as_on_gpu(optimizer: torch.optim.Optimizer) -> None:
    """Step ``optimizer`` with the multi-tensor (``foreach``) kernels torch picks on CUDA: on a CPU
    it loops over the tensors, launching a GPU's kernel count many times over."""
    for group in optimizer.param_groups:
        if "foreach" in group:
            group["foreach"] = True
