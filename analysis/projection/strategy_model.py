"""What each strategy issues per optimizer step and how it holds the model state (a
:class:`StrategyModel`, which every strategy class declares of itself): its model-state bytes per
rank, DDP's gradient buckets and tensor parallelism's per-layer exchanges. step_model.py schedules
them into a step. Pure functions on numbers, as the rest of the projection."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from analysis.projection.collectives import MiB
from analysis.projection.inputs import ModelShape

ADAM_BYTES_PER_PARAM = 8  # two fp32 moments
LOW_BYTES = {"bf16": 2, "fp16": 2}  # training.precision's 16-bit dtypes
DDP_FIRST_BUCKET = 1 * MiB  # torch's dist._DEFAULT_FIRST_BUCKET_BYTES
DDP_BUCKET = 25 * MiB  # DDP's default bucket_cap_mb (configs/strategies/ddp.yaml)


@dataclass(frozen=True)
class StrategyModel:
    """What a strategy issues per optimizer step and how it holds the model state: each strategy
    class describes itself by one (``StrategyConfig.cost_model``, strategies/strategy.py), keyed
    by the label its records carry."""

    label: str
    grads: str  # how gradients are combined: none | ddp_buckets | all_reduce | reduce_scatter (one collective each)
    gather: str = "none"  # parameter all-gathers: none | after_step | before_forward | per_unit (forward and backward)
    sharded_state: bool = False  # gradients and optimizer state sharded 1/P
    sharded_params: str = "none"  # none | trainable (FSDP leaves frozen ones whole) | all (ZeRO-3)
    master: bool = False  # ZeRO's fp32 master partition
    norm: bool = False  # DeepSpeed's all-reduce of the gradient norm, one float per step
    offload: bool = False  # optimizer state and step on the host
    # under bf16/fp16 the module itself is cast (DeepSpeed): parameters and gradients 16-bit, an fp32
    # master copy keeps the weights (stage 0 too, whole); False: autocast and FSDP's mixed precision
    # keep both fp32 and cast only what they compute with
    casts_module: bool = False
    tp: int = 1  # ranks each layer is cut over (tensor parallelism); 0: every rank
    bucket_bytes: float = DDP_BUCKET  # ddp_buckets: DDP's bucket cap (bucket_cap_mb)
    # ranks one replica of the state is sharded over: world (every data-parallel rank), node (one
    # node's: hybrid sharding, the replicas' shards all-reduced across nodes) or a number
    shard: int | str = "world"
    # a hybrid strategy's full-sharding sibling (hsdp: fsdp2), which runs the same code at one rank
    one_rank_as: str | None = None

    @property
    def multi_rank(self) -> bool:
        """Whether it runs over several ranks; one that neither combines gradients nor cuts layers
        (single) runs on one rank only."""
        return self.grads != "none" or self.tp != 1

    def held_bytes(self, shape: ModelShape) -> int:
        """Bytes per element of the parameters and gradients it holds when training in
        ``shape.precision``."""
        return LOW_BYTES.get(shape.precision, shape.dtype_bytes) if self.casts_module else shape.dtype_bytes

    def tp_ranks(self, ranks: int) -> int:
        return ranks if self.tp == 0 else min(self.tp, ranks)

    def shard_ranks(self, dp: int, ranks_per_node: int | None) -> int:
        """Ranks each replica's sharded state is cut over, of ``dp`` data-parallel ones with
        ``ranks_per_node`` on a node (None: all on one)."""
        if self.shard == "world":
            size = dp
        elif self.shard == "node":
            size = ranks_per_node or dp
        else:
            size = int(self.shard)
        return max(1, min(size, dp))


@dataclass(frozen=True)
class Exchange:
    op: str
    nbytes: float


def tp_exchanges(shape: ModelShape, samples: float) -> list[tuple[Exchange | None, Exchange | None]]:
    """Per layer, the TP collective after its forward and after its backward, under the pairs plan
    (strategies/backends/tp_plan.py) as if the TP degree divided every width it cuts: a pair
    (colwise, rowwise) all-reduces the pair's output forward and the colwise layer's input gradient
    backward; a layer left over is rowwise, all-reducing its output forward and all-gathering its
    input gradient backward. The model's input needs no gradient. Bytes: ``samples`` activations."""
    if len(shape.widths) != len(shape.units) + 1:
        raise ValueError(
            f"tensor parallelism is projected from the layer widths of a layer stack; {shape.label} "
            "has none (give a zoo model)"
        )
    widths, n = shape.widths, len(shape.widths) - 1

    def exchange(op: str, width: int) -> Exchange:
        return Exchange(op, samples * width * shape.dtype_bytes)

    plan: list[tuple[Exchange | None, Exchange | None]] = []
    for i in range(n):
        gradient = i > 0
        if i % 2 == 1:  # rowwise, second of a pair: handed the shard, it sums its output
            plan.append((exchange("all_reduce", widths[i + 1]), None))
        elif i == n - 1:  # rowwise, left over: handed the whole input
            plan.append(
                (exchange("all_reduce", widths[i + 1]), exchange("all_gather", widths[i]) if gradient else None)
            )
        else:  # colwise, first of a pair: its input gradient is partial on every rank
            plan.append((None, exchange("all_reduce", widths[i]) if gradient else None))
    return plan


def model_state(m: StrategyModel, shape: ModelShape, ranks: int, ranks_per_node: int | None = None) -> dict[str, float]:
    """Bytes per rank as the suite's records count them (docs/metrics.md): parameters and
    gradients in what the backend holds them in under ``shape.precision`` (:meth:`StrategyModel.held_bytes`;
    an offloaded gradient partition fp32 on the host), Adam's two fp32 moments, the fp32 master copy
    (ZeRO's partition; a module cast to 16 bits keeps one at stage 0 too, whole); padding and Adam's
    step counters ignored. Tensor parallelism cuts every tensor by its degree (as if it divided every
    width), and the sharding strategies shard over the data-parallel ranks that remain (hybrid
    sharding: over its shard group, ``ranks_per_node`` ranks by default)."""
    b, held = shape.dtype_bytes, m.held_bytes(shape)
    tp = m.tp_ranks(ranks)
    ranks = m.shard_ranks(ranks // tp, ranks_per_node)
    trainable, frozen = shape.trainable / tp, (shape.params - shape.trainable) / tp
    params = {"none": trainable + frozen, "trainable": trainable / ranks + frozen, "all": (trainable + frozen) / ranks}[
        m.sharded_params
    ]
    state = trainable / ranks if m.sharded_state else trainable
    return {
        "params": params * held,
        "grads": state * (b if m.offload else held),
        "optimizer": ADAM_BYTES_PER_PARAM * state,
        "master_params": state * b if m.master or held != b else 0.0,
    }


def ddp_buckets(tensor_bytes: Sequence[float], cap: float = DDP_BUCKET, first: float = DDP_FIRST_BUCKET) -> list[float]:
    """DDP's gradient buckets in the order they fill: tensors in reverse registration order, a
    bucket closes once it reaches its cap (1 MiB for the first, bucket_cap_mb after)."""
    buckets, current, limit = [], 0.0, min(first, cap)
    for size in reversed(tensor_bytes):
        current += size
        if current >= limit:
            buckets.append(current)
            current, limit = 0.0, cap
    return buckets + ([current] if current else [])
