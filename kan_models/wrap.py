"""The units the FSDP strategies shard one by one (FSDP1's auto-wrap policy, FSDP2's
``fully_shard`` calls, Accelerate's ``_no_split_modules``).

With a ``model.wrap`` policy: every submodule of the named classes, or else, walking down from
the root through containers (``ModuleList``, ``Sequential``, ``ModuleDict``), each child holding
at least ``min_params`` parameters. Without one, a zoo model's own units (``blocks``: one per KAN
layer), and any other model's children as by the default policy. Parameters left outside every
unit belong to the root's unit.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

from torch import nn

from kan_models.base import WrapPolicy

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def wrap_units(model: nn.Module, policy: WrapPolicy | None = None) -> list[nn.Module]:
    if policy is None and hasattr(model, "blocks"):
        return list(cast(Iterable[nn.Module], model.blocks))  # a zoo model's ModuleList
    policy = policy or WrapPolicy()
    if policy.classes:
        wanted = set(policy.classes)
        return [m for m in model.modules() if m is not model and type(m).__name__ in wanted]
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, CONTAINERS):
                visit(child)
            elif sum(p.numel() for p in child.parameters()) >= policy.min_params:
                units.append(child)

    visit(model)
    return units
