"""A training step's time on a GPU from its operations: each kernel costs at least the host's
dispatch and launch of it, else the longer of its FLOPs at the achieved rate and its bytes at the
memory bandwidth (a roofline per op); the device runs them one after another, so the step is their
sum, and the bound that dominates it is named. Pure numbers: the ops are counted by
launchers/recommend/step_ops.py."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

BOUNDS = ("launches/host", "compute", "memory bandwidth")


@dataclass(frozen=True)
class Op:
    """One kernel: its aten op, the phase of the step it runs in, its FLOPs and the bytes it reads
    and writes."""

    name: str
    phase: str  # forward | backward | optimizer
    flops: float
    bytes: float


@dataclass(frozen=True)
class StepOps:
    """The kernels of one training step of a model at ``micro_batch`` samples."""

    model: str
    micro_batch: int
    ops: tuple[Op, ...]

    @property
    def kernels(self) -> int:
        return len(self.ops)

    @property
    def flops(self) -> float:
        return sum(o.flops for o in self.ops)

    @property
    def bytes(self) -> float:
        return sum(o.bytes for o in self.ops)


@dataclass(frozen=True)
class Device:
    """What one op costs on a device: the host's dispatch and launch per kernel, the achieved
    FLOP rate, the memory bandwidth."""

    host_s_per_kernel: float
    flops_per_s: float
    bytes_per_s: float

    def op_s(self, op: Op) -> tuple[float, str]:
        """The op's time and what bounds it (launches/host on a tie: nothing runs faster than it is issued)."""
        times = (self.host_s_per_kernel, op.flops / self.flops_per_s, op.bytes / self.bytes_per_s)
        longest = max(times)
        return longest, BOUNDS[times.index(longest)]


@dataclass(frozen=True)
class DeviceTime:
    """A step's time per phase and the seconds each bound accounts for."""

    phases: dict[str, float]
    by_bound: dict[str, float]
    kernels: int

    @property
    def step_s(self) -> float:
        return sum(self.phases.values())

    @property
    def bound(self) -> str:
        """The bound that accounts for most of the step."""
        return max(self.by_bound, key=lambda b: self.by_bound[b])

    @property
    def shares(self) -> dict[str, float]:
        """Of the step, the share each bound accounts for."""
        return {b: s / self.step_s for b, s in self.by_bound.items()} if self.step_s else {}

    def phase_s(self, *names: str) -> float:
        return sum(self.phases.get(n, 0.0) for n in names)


def device_time(ops: Iterable[Op], device: Device) -> DeviceTime:
    """The step's time on ``device``: each op at its roofline with the host's floor, summed."""
    phases: dict[str, float] = {}
    by_bound = dict.fromkeys(BOUNDS, 0.0)
    kernels = 0
    for op in ops:
        seconds, bound = device.op_s(op)
        phases[op.phase] = phases.get(op.phase, 0.0) + seconds
        by_bound[bound] += seconds
        kernels += 1
    return DeviceTime(phases, by_bound, kernels)
