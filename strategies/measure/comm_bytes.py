"""The bytes one training step moves, by the links they cross: inside a node or across nodes.

Every collective a backend issues reaches torch's dispatcher, so one TorchDispatchMode over a
step sees them all, whichever library called: DDP's reducer, FSDP1 and FSDP2 and DeepSpeed as
``c10d`` ops with their process group, DTensor's (tensor parallelism) as functional ops
(``_c10d_functional``) naming theirs. Each is counted as the
bytes a rank sends by the ring algorithm nccl-tests assumes (the projection's cost model,
analysis/projection/collectives.py): an all-reduce of S bytes over P ranks sends 2 (P - 1) / P x S,
an all-gather (S its output) and a reduce-scatter (S its input) (P - 1) / P x S, a broadcast or a
reduce S. A group whose ranks lie on more than one node is one ring over the slower links, so its
bytes count as inter-node; a group inside one node as intra-node.

The mode sends every operation of the step through Python, so it runs on one warm-up step (its
time is never in a timing window) and only where nothing is compiled (a compiled graph would
trace the mode, not run under it)."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from analysis.records.schema import CommBytes
from strategies.runtime.distributed import DistEnv

_c10d = torch.ops.c10d
# op -> (kind, which argument holds the whole buffer S)
COLLECTIVES: dict[Any, tuple[str, int]] = {
    _c10d.allreduce_.default: ("all_reduce", 0),
    _c10d.allreduce_coalesced_.default: ("all_reduce", 0),
    _c10d._allgather_base_.default: ("all_gather", 0),
    _c10d.allgather_.default: ("all_gather", 0),
    _c10d.allgather_coalesced_.default: ("all_gather", 0),
    _c10d.allgather_into_tensor_coalesced_.default: ("all_gather", 0),
    _c10d._reduce_scatter_base_.default: ("reduce_scatter", 1),
    _c10d.reduce_scatter_.default: ("reduce_scatter", 1),
    _c10d.reduce_scatter_tensor_coalesced_.default: ("reduce_scatter", 1),
    _c10d.broadcast_.default: ("broadcast", 0),
    _c10d.reduce_.default: ("reduce", 0),
    _c10d.alltoall_base_.default: ("all_to_all", 1),
    _c10d.alltoall_.default: ("all_to_all", 1),
}

_functional = torch.ops._c10d_functional
# DTensor's collectives (tensor parallelism, FSDP2's DTensor ops): functional ops on a group named by
# their last argument; op -> (kind, whether the whole buffer S is the input times the group's size)
FUNCTIONAL: dict[Any, tuple[str, bool]] = {
    _functional.all_reduce.default: ("all_reduce", False),
    _functional.all_reduce_.default: ("all_reduce", False),
    _functional.all_reduce_coalesced.default: ("all_reduce", False),
    _functional.all_gather_into_tensor.default: ("all_gather", True),
    _functional.all_gather_into_tensor_coalesced.default: ("all_gather", True),
    _functional.reduce_scatter_tensor.default: ("reduce_scatter", False),
    _functional.reduce_scatter_tensor_coalesced.default: ("reduce_scatter", False),
    _functional.all_to_all_single.default: ("all_to_all", False),
    _functional.broadcast.default: ("broadcast", False),
}


def sent_bytes(kind: str, nbytes: int, ranks: int) -> float:
    """What one rank sends for a collective of ``nbytes`` over ``ranks`` ranks (a ring)."""
    if ranks <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (ranks - 1) / ranks * nbytes
    if kind in ("broadcast", "reduce"):
        return float(nbytes)
    return (ranks - 1) / ranks * nbytes


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


@dataclass(frozen=True)
class Collective:
    """One kind of collective call: ``elements`` is the whole buffer S (an all-gather's output, a
    reduce-scatter's input), counted by elements, not storage, which a list all-gather's views share."""

    kind: str
    ranks: int
    link: str
    elements: int
    dtype: str
    nbytes: int

    @property
    def sent(self) -> float:
        """What this rank sends for one such call."""
        return sent_bytes(self.kind, self.nbytes, self.ranks)


class CollectiveBytes(TorchDispatchMode):
    """Counts, while active, the bytes this rank sends by link (``intra``, ``inter``) and the
    collectives issued on each."""

    def __init__(self, ranks_per_node: int) -> None:
        super().__init__()
        self.ranks_per_node = max(1, ranks_per_node)
        self.sent: dict[str, float] = defaultdict(float)
        self.count: dict[str, int] = defaultdict(int)
        self._links: dict[int, tuple[str, int]] = {}
        self.calls: Counter[Collective] = Counter()

    def link(self, group: Any) -> tuple[str, int]:
        """``(intra|inter, ranks)`` of a process group, by the nodes its ranks lie on."""
        key = id(group)
        if key not in self._links:
            ranks = dist.get_process_group_ranks(group)
            nodes = {r // self.ranks_per_node for r in ranks}
            self._links[key] = ("inter" if len(nodes) > 1 else "intra", len(ranks))
        return self._links[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        found = COLLECTIVES.get(func)
        # the op's process group, boxed for the dispatcher: every c10d op's first script object
        boxed = next((a for a in args if isinstance(a, torch.ScriptObject)), None) if found else None
        if found is not None and boxed is not None:
            kind, buffer = found
            self.count_call(kind, dist.ProcessGroup.unbox(boxed), _tensors(args[buffer]), 1)
        elif func in FUNCTIONAL:
            kind, gathered = FUNCTIONAL[func]
            named = args[-1]
            group = (
                dist.ProcessGroup.unbox(named)
                if isinstance(named, torch.ScriptObject)
                else _resolve_process_group(named)
            )
            self.count_call(kind, group, _tensors(args[0]), group.size() if gathered else 1)
        return func(*args, **(kwargs or {}))

    def count_call(self, kind: str, group: Any, tensors: list[torch.Tensor], times: int) -> None:
        """One collective of ``kind`` on ``group`` whose whole buffer is ``tensors``, ``times`` over."""
        link, ranks = self.link(group)
        dtype = str(tensors[0].dtype).removeprefix("torch.") if tensors else "none"
        nbytes = times * sum(t.numel() * t.element_size() for t in tensors)
        call = Collective(kind, ranks, link, times * sum(t.numel() for t in tensors), dtype, nbytes)
        self.sent[link] += call.sent
        self.count[link] += 1
        self.calls[call] += 1

    def record(self, step: int) -> CommBytes:
        """What this rank counted, as a run's record gives it for ``step`` (1-based)."""
        return CommBytes(
            step=step,
            intra_node_bytes=self.sent["intra"],
            inter_node_bytes=self.sent["inter"],
            intra_node_collectives=self.count["intra"],
            inter_node_collectives=self.count["inter"],
        )


class StepCommBytes:
    """The bytes one chosen step moves, counted on every rank: the rank that sends the most
    (max over ranks, as the record's other per-rank figures) is what is recorded."""

    def __init__(self, env: DistEnv, step: int | None) -> None:
        self.env, self.step = env, step
        self.counted: CollectiveBytes | None = None

    @contextmanager
    def around(self, step: int) -> Iterator[None]:
        if step != self.step or self.env.world_size == 1:
            yield
            return
        self.counted = CollectiveBytes(self.env.local_world_size)
        with self.counted:
            yield

    def result(self) -> CommBytes | None:
        """The counted step's bytes and collectives by link, the maximum over ranks (a collective:
        every rank calls it); None where no step was counted (one process, a compiled run, a
        resumed run that started past its warm-up)."""
        if self.step is None or self.env.world_size == 1:
            return None
        c = self.counted or CollectiveBytes(self.env.local_world_size)
        local = torch.tensor(
            [c.sent["intra"], c.sent["inter"], c.count["intra"], c.count["inter"], self.counted is not None],
            dtype=torch.float64,
        )
        intra, inter, n_intra, n_inter, counted = self.env.all_reduce(local.to(self.env.device), "max").cpu().tolist()
        if not counted:
            return None
        return CommBytes(
            step=self.step + 1,
            intra_node_bytes=intra,
            inter_node_bytes=inter,
            intra_node_collectives=int(n_intra),
            inter_node_collectives=int(n_inter),
        )
