"""This process as one rank of a world that is not there: torch's fake process group, whose
collectives return at once without sending (their outputs are left as they were)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.testing._internal.distributed.fake_pg import FakeStore

from kanscale.errors import ConfigError
from strategies.runtime.distributed import DistEnv


@contextmanager
def fake_world(world_size: int, ranks_per_node: int, rank: int = 0) -> Iterator[DistEnv]:
    """Join a fake process group of ``world_size`` ranks, ``ranks_per_node`` to a node, as ``rank``;
    the environment a launcher would have given that rank. The group is left on exit."""
    if dist.is_initialized():
        raise RuntimeError("a rehearsal runs in a process of its own: this one is already in a process group")
    if world_size % ranks_per_node:
        raise ConfigError(
            f"--nproc-per-node: {world_size} ranks do not fill nodes of {ranks_per_node}; give a world size "
            "that is a multiple of the ranks per node"
        )
    if not 0 <= rank < world_size:
        raise ConfigError(f"--rank: {rank} is not a rank of a {world_size}-rank world; give 0 to {world_size - 1}")
    # What a launcher exports to each rank (Accelerate reads it to find its distributed setting).
    launcher = {
        "RANK": rank,
        "WORLD_SIZE": world_size,
        "LOCAL_RANK": rank % ranks_per_node,
        "LOCAL_WORLD_SIZE": ranks_per_node,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": 29500,
    }
    saved = {name: os.environ.get(name) for name in launcher}
    os.environ.update({name: str(value) for name, value in launcher.items()})
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield DistEnv(
            rank=rank,
            world_size=world_size,
            local_rank=rank % ranks_per_node,
            local_world_size=ranks_per_node,
            launcher="rehearsal",
            nodes=world_size // ranks_per_node,
            joined_process_group=True,
        )
    finally:
        dist.destroy_process_group()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# Unannotated: DDP checks a hook's annotations against its own classes, and this module's are strings.
def _bucket_back(group, bucket):
    dist.all_reduce(bucket.buffer(), group=group)
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def answer_ddp_buckets(model: torch.nn.Module) -> None:
    """DDP's reducer reads each bucket's all-reduce result from the collective's future, which a
    fake group leaves empty: a communication hook that issues the same all-reduce and answers
    with the bucket keeps DDP's own bucketing, order and bytes. On a real group, nothing to do."""
    if dist.get_backend() != dist.Backend.FAKE:
        return
    for module in model.modules():
        if isinstance(module, DistributedDataParallel):
            module.register_comm_hook(module.process_group, _bucket_back)
