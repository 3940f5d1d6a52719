"""Tensor parallelism for KAN layers on PyTorch's DTensor (``torch.distributed.tensor``).

Each zoo layer declares how it may be cut (:class:`kan_models.base.LayerSplit`); :func:`layer_plans`
chooses, per layer of a :class:`~kan_models.base.LayerStack`, one of

- ``colwise``: the layer's outputs are split over the TP ranks; each computes its outputs from the
  whole input (the input's gradient is then a partial sum, all-reduced in backward);
- ``rowwise``: its inputs are split; each rank contracts its inputs and the partial outputs are
  all-reduced;
- ``whole``: not cut (a width the TP degree does not divide, a layer that declares no split);

and :func:`apply_tp` applies them with ``parallelize_module``, one :class:`KANLayerParallel` style
per layer, as torchtitan writes plans for its models. A colwise layer followed by a rowwise one
hands its output shard straight over (Megatron's pairing, the ``pairs`` plan's aim): a pair costs
one all-reduce of a (batch, out) activation forward and one of a (batch, in) input gradient
backward, whatever the parameter count; a layer handing on a whole output from a colwise split
all-gathers it instead.

KAN layers compute with ops DTensor has no sharding rules for (a custom autograd function,
scatter-adds, CSR products), so every layer runs on its local shards under ``local_map``: the
parameters stay DTensors (what the optimizer, FSDP2 and DCP see), the arithmetic is the plain
layer's own on local tensors, and the placements say what each local result is (a shard, a
partial sum, a copy).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast, runtime_checkable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.experimental import local_map
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from kan_models.base import LayerSplit, LayerStack

PLANS = {
    "pairs": "a colwise layer followed by a rowwise one wherever two consecutive layers allow (Megatron), "
    "a layer left over rowwise",
    "colwise": "every layer's outputs split, gathered whole after each layer",
    "rowwise": "every layer's inputs split, partial outputs all-reduced after each layer",
}
# Activations are (batch, features); DTensor wants the feature dimension by its number.
FEATURES = Shard(1)
# What a layer's local computation takes and returns, by split: the input's placement, the output's.
COMPUTE: dict[str, tuple[Placement, Placement]] = {
    "colwise": (Replicate(), FEATURES),
    "rowwise": (FEATURES, Partial()),
    "whole": (Replicate(), Replicate()),
}
# What the local gradient of the layer's input is: colwise outputs each carry part of it.
INPUT_GRAD: dict[str, Placement] = {"colwise": Partial(), "rowwise": FEATURES, "whole": Replicate()}


@dataclass(frozen=True)
class LayerPlan:
    split: str  # colwise | rowwise | whole
    receives: Placement  # the input as the previous layer hands it on (Replicate, or a colwise FEATURES shard)
    hands_on: Placement  # the output as the next layer takes it


@runtime_checkable
class SplitLayer(Protocol):
    """A layer that declares how tensor parallelism may cut it (bspline, rbf, chebyshev)."""

    in_features: int
    out_features: int

    def layer_split(self) -> LayerSplit: ...


def declared_split(layer: nn.Module) -> LayerSplit | None:
    return layer.layer_split() if isinstance(layer, SplitLayer) else None


def can_split(layer: nn.Module, tp: int) -> dict[str, bool]:
    if not isinstance(layer, SplitLayer):
        return {"colwise": False, "rowwise": False}
    return {
        "colwise": layer.out_features % tp == 0,
        "rowwise": layer.layer_split().inputs is not None and layer.in_features % tp == 0,
    }


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The layers tensor parallelism cuts: a zoo model's blocks (:class:`LayerStack`), or those of
    a custom model under the same name, which ``check_model_splits`` makes sure it has."""
    return cast(LayerStack, model).blocks


def layer_plans(layers: Sequence[nn.Module], tp: int, plan: str) -> list[LayerPlan]:
    """The split of every layer under ``plan`` (see :data:`PLANS`) at TP degree ``tp``; a layer
    the plan's split does not fit takes the other one, or stays whole."""
    able = [can_split(layer, tp) for layer in layers]
    splits: list[str] = []
    while len(splits) < len(layers):
        i = len(splits)
        if plan == "pairs" and able[i]["colwise"] and i + 1 < len(layers) and able[i + 1]["rowwise"]:
            splits += ["colwise", "rowwise"]
            continue
        order = ("colwise", "rowwise") if plan == "colwise" else ("rowwise", "colwise")
        splits.append(next((s for s in order if able[i][s]), "whole"))
    plans: list[LayerPlan] = []
    receives: Placement = Replicate()
    for i, split in enumerate(splits):
        paired = split == "colwise" and i + 1 < len(splits) and splits[i + 1] == "rowwise"
        hands_on = FEATURES if paired else Replicate()
        plans.append(LayerPlan(split, receives, hands_on))
        receives = hands_on
    return plans


def split_dims(layer: nn.Module, split: str) -> dict[str, int]:
    """The tensors ``split`` cuts, with the dimension each is cut along."""
    declared = declared_split(layer)
    if declared is None or split == "whole":
        return {}
    return declared.outputs if split == "colwise" else declared.inputs or {}


@contextlib.contextmanager
def swapped(module: nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """``module``'s parameters and buffers replaced by ``tensors`` (dotted names) for the block.
    Writes the modules' own slots: assigning a plain tensor to a parameter's name is refused by
    ``nn.Module.__setattr__``, and ``torch.func.functional_call`` would call the module again,
    its TP and FSDP hooks included."""
    saved = []
    for name, tensor in tensors.items():
        owner, _, leaf = name.rpartition(".")
        sub = module.get_submodule(owner)
        # a parameter's slot takes a plain tensor here, which is the point of writing the slots
        slots: dict[str, Any] = sub._parameters if leaf in sub._parameters else sub._buffers
        saved.append((slots, leaf, slots[leaf]))
        slots[leaf] = tensor
    try:
        yield
    finally:
        for slots, leaf, old in reversed(saved):
            slots[leaf] = old


def module_tensors(module: nn.Module) -> list[str]:
    return [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]


class KANLayerParallel(ParallelStyle):
    """One KAN layer cut as ``plan`` says: its split tensors become sharded DTensors, the others
    replicated ones, and its forward runs the layer's own code on the local shards (local_map)."""

    def __init__(self, plan: LayerPlan) -> None:
        super().__init__()
        self.plan = plan

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        dims = split_dims(module, self.plan.split)

        def partition(name: str, sub: nn.Module, mesh: DeviceMesh) -> None:
            prefix = f"{name}." if name else ""
            for leaf, param in list(sub.named_parameters(recurse=False)):
                if prefix + leaf in dims:
                    shard = distribute_tensor(param.data, mesh, [Shard(dims[prefix + leaf])])
                    sub.register_parameter(leaf, nn.Parameter(shard, requires_grad=param.requires_grad))
            for leaf, buffer in list(sub.named_buffers(recurse=False)):
                if prefix + leaf in dims:
                    sub.register_buffer(leaf, distribute_tensor(buffer, mesh, [Shard(dims[prefix + leaf])]))

        # the rest: replicated. torch types the hooks as returning None, but uses what they return.
        distribute_module(module, device_mesh, partition, self._receive, self._hand_on)  # type: ignore[arg-type]
        module.forward = self._local_forward(module, device_mesh)
        return module

    def _receive(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        (x,) = inputs
        return (DTensor.from_local(x, mesh, [self.plan.receives], run_check=False),)

    def _hand_on(self, module: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        return output.redistribute(mesh, [self.plan.hands_on]).to_local()

    def _local_forward(self, module: nn.Module, mesh: DeviceMesh):
        split = self.plan.split
        names = module_tensors(module)
        params = set(dict(module.named_parameters()))

        def current() -> list[DTensor]:
            # Read at every call: FSDP2 puts its gathered parameters in place before the forward.
            # distribute_module made every one a DTensor.
            return cast(
                list[DTensor], [module.get_parameter(n) if n in params else module.get_buffer(n) for n in names]
            )

        placements = [t.placements for t in current()]
        # A whole tensor in a cut layer gets a partial gradient on each rank (its share of the
        # outputs, or of the inputs' sum); a cut one its own shard's exact gradient.
        grads = [p if split == "whole" or isinstance(p[0], Shard) else (Partial(),) for p in placements]
        declared = declared_split(module)
        once = set(declared.once) if split == "rowwise" and declared is not None else set()
        first = mesh.get_local_rank() == 0
        layer_forward = type(module).forward  # the class's: this instance's forward is replaced

        def compute(x: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
            # A bias added after a row-split contraction is added by one rank (to the sum).
            local = {n: t if n not in once or first else t * 0 for n, t in zip(names, tensors, strict=True)}
            with swapped(module, local):
                return layer_forward(module, x)

        compute_in, compute_out = COMPUTE[split]
        mapped = local_map(
            compute,
            out_placements=[compute_out],
            in_placements=([compute_in], *placements),
            in_grad_placements=([INPUT_GRAD[split]], *grads),
            device_mesh=mesh,
            redistribute_inputs=True,
        )
        return lambda x: mapped(x, *current())


def apply_tp(model: nn.Module, mesh: DeviceMesh, plan: str) -> list[LayerPlan]:
    """Cut every layer of ``model`` (a LayerStack) over the 1-D ``mesh``; returns the layers' plans."""
    plans = layer_plans(blocks_of(model), mesh.size(), plan)
    parallelize_module(model, mesh, {f"layers.{i}": KANLayerParallel(p) for i, p in enumerate(plans)})
    return plans


@torch.no_grad()
def reduce_partial_gradients(model: nn.Module) -> None:
    """Sum the partial gradients of whole tensors in cut layers over the TP ranks, before the
    optimizer and gradient clipping read them (FSDP2 does the same for its TP parameters)."""
    for param in model.parameters():
        if isinstance(param, DTensor) and isinstance(param.grad, DTensor) and param.grad.placements != param.placements:
            param.grad = param.grad.redistribute(placements=param.placements)


def local_share(model: nn.Module, plans: Sequence[LayerPlan], rank: int, tp: int) -> nn.Module:
    """This TP rank's part of ``model`` as a plain module, in place: each layer holds the shards
    it holds under tensor parallelism and computes what that rank computes, with every collective
    left out (a partial sum stands for its all-reduce, copies of a shard for its all-gather).
    The compute baseline times it, so that exposed communication is TP's collectives alone."""
    for layer, plan in zip(blocks_of(model), plans, strict=True):
        for name, dim in split_dims(layer, plan.split).items():
            owner, _, leaf = name.rpartition(".")
            sub = layer.get_submodule(owner)
            part = getattr(sub, leaf).detach().tensor_split(tp, dim)[rank].clone()
            if leaf in sub._parameters:
                sub.register_parameter(leaf, nn.Parameter(part))
            else:
                sub.register_buffer(leaf, part)
        layer.forward = _local_layer_forward(layer, plan, rank, tp)
    return model


def _local_layer_forward(layer: nn.Module, plan: LayerPlan, rank: int, tp: int):
    layer_forward = type(layer).forward
    compute_in, compute_out = COMPUTE[plan.split]

    def forward(x: torch.Tensor) -> torch.Tensor:
        if compute_in != plan.receives:  # a whole input to a row split: the rank's slice, as DTensor takes it
            x = x.tensor_split(tp, -1)[rank]
        out = layer_forward(layer, x)
        if isinstance(compute_out, Shard) and plan.hands_on == Replicate():
            out = torch.cat([out] * tp, dim=-1)  # stands for the all-gather: the next layer's input width
        return out

    return forward
