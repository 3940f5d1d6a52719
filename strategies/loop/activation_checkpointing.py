"""Activation checkpointing: a unit keeps no activations from its forward, only its inputs, and
runs its forward again in backward where its gradients need them.

Applied to the unwrapped model, before any strategy wraps it, with torch's composable
``checkpoint`` (pre- and post-forward hooks: the module tree and its parameter names stay as they
are, so FSDP's units, ZeRO's hooks, tensor-parallel plans and checkpoints see the same model). The
recomputation calls the unit again, so the hooks a backend put on it (FSDP's unshard, ZeRO-3's
gather) run for it as for the forward. It is the same unit everywhere: what FSDP shards one by
one (kan_models/wrap.py), so a layer is recomputed whole while its parameters are gathered.
"""

from __future__ import annotations

from torch import nn


def apply_activation_checkpointing(units: list[nn.Module], every: int = 1) -> list[nn.Module]:
    """Checkpoint every ``every``-th of ``units`` (the ``every``-th, then twice that, ...: as
    torchtitan's selective checkpointing counts); the units checkpointed."""
    from torch.distributed._composable import checkpoint

    chosen = units[every - 1 :: every]
    for unit in chosen:
        checkpoint(unit)
    return chosen
