"""Where this process sits among the ranks, and the few collectives the loop itself needs.

Every launcher (torchrun, accelerate launch, the deepspeed launcher, srun) exports the same
environment variables; one process started by hand has none of them and is rank 0 of 1.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from kanscale.machine import cpu_model
from strategies.runtime.mesh import MeshShape, RunMesh


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def detect_launcher() -> str:
    """Which launcher started this process, from the variables each one exports."""
    if os.environ.get("KANSCALE_LAUNCHER"):
        return os.environ["KANSCALE_LAUNCHER"]  # set by kanscale's own generated commands (e.g. under SLURM)
    if "ACCELERATE_MIXED_PRECISION" in os.environ:
        return "accelerate"  # accelerate launch (it uses torchrun underneath)
    if "CROSS_RANK" in os.environ:
        return "deepspeed"
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return "torchrun"
    return "none"


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    launcher: str = "none"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    nodes: int = 1
    # Set once this process joined a process group: leaving it then needs care (see
    # launchers.cli.common.exit_without_teardown).
    joined_process_group: bool = False
    # Where this rank sits on the run's device mesh (strategies/runtime/mesh.py): the loop places the
    # environment on its strategy's mesh (on_mesh) before it cuts any batch; until then, and for a
    # process that trains nothing, every rank is a whole data-parallel replica.
    mesh: RunMesh = field(init=False)

    def __post_init__(self) -> None:
        self.mesh = RunMesh(MeshShape(dp_replicate=self.world_size), self.rank, self.device.type)

    def on_mesh(self, shape: MeshShape) -> DistEnv:
        """This environment, placed on a run mesh of ``shape`` (its sizes multiply to the world size)."""
        env = dataclasses.replace(self)
        env.mesh = RunMesh(shape, self.rank, self.device.type)
        return env

    @classmethod
    def from_environ(cls, device: str = "auto") -> DistEnv:
        world = _env_int("WORLD_SIZE", 1)
        local_rank = _env_int("LOCAL_RANK", 0)
        # torchrun exports LOCAL_WORLD_SIZE and GROUP_WORLD_SIZE (one group per node), the
        # deepspeed launcher LOCAL_SIZE and CROSS_SIZE.
        local_world = _env_int("LOCAL_WORLD_SIZE", _env_int("LOCAL_SIZE", world))
        return cls(
            rank=_env_int("RANK", 0),
            world_size=world,
            local_rank=local_rank,
            local_world_size=local_world,
            launcher=detect_launcher(),
            device=pick_device(device, local_rank),
            nodes=_env_int("CROSS_SIZE", _env_int("GROUP_WORLD_SIZE", max(1, world // local_world))),
        )

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def comm_backend(self) -> str | None:
        return dist.get_backend() if self.distributed else None

    def init_process_group(self, timeout_s: float) -> None:
        """Join the launch's process group: NCCL on GPUs, gloo on CPUs. A process started by
        hand (no launcher) gets a one-rank group, so distributed strategies also run at world
        size 1 (the baseline of a strong-scaling curve)."""
        if self.distributed:
            return
        self.joined_process_group = True
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        timeout = timedelta(seconds=timeout_s)
        # The groups backends create later (DeepSpeed clones the world group with new_group(), device
        # meshes make their own) take torch's module default, 30 minutes, not the world group's
        # timeout: set the default too, so a rank that hangs is given up on after runtime.timeout_s
        # whichever group the others wait in. (Timing puts no barrier on the world group before
        # each step that would catch the hang there.)
        c10d.default_pg_timeout = timeout
        if backend == "nccl":
            c10d.default_pg_nccl_timeout = timeout
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, rank=self.rank, world_size=self.world_size, timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)

    def shutdown(self) -> None:
        """Leave the process group. The barrier first matters: a rank that destroys the group
        while another still talks to it can abort ("terminate called without an active exception")."""
        if self.distributed:
            dist.barrier()
            dist.destroy_process_group()

    def broadcast_tensors(self, tensors: list[torch.Tensor]) -> None:
        """Overwrite every rank's tensors with rank 0's, in place."""
        if self.distributed and self.world_size > 1:
            for t in tensors:
                dist.broadcast(t, src=0)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def synchronize(self) -> None:
        """Wait for queued device work, then for every rank: the edge of a timed window."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.barrier()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place sum or max over ranks (a no-op for one process)."""
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return tensor

    def gather_strings(self, value: str) -> list[str]:
        if not self.distributed:
            return [value]
        out: list[str | None] = [None] * self.world_size
        dist.all_gather_object(out, value)
        return [str(v) for v in out]

    def ranks_differing(self, value: str) -> list[int]:
        """The ranks whose ``value`` is not rank 0's (a collective: every rank calls it)."""
        values = self.gather_strings(value)
        return [rank for rank, v in enumerate(values) if v != values[0]]

    def broadcast_string(self, value: str) -> str:
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def pick_device(device: str, local_rank: int = 0) -> torch.device:
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model()


def hostname() -> str:
    """This machine's name; under SLURM the node's name in the cluster (SLURMD_NODENAME), which
    is what its tools show and what tells two node entries on one machine apart."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()
