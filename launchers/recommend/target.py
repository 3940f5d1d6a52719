"""Where ``kanscale recommend`` places the training: a cluster file's nodes (their device memory,
links and compute rate, all stated), or this machine (its memory, and its links measured now with
``kanscale commbench`` unless commbench files are given). Every input problem is a ConfigError
naming the flag or the file's key and the fix."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from analysis import projection as pj
from analysis.projection.advice import Target
from analysis.projection.device_time import Device, StepOps, device_time
from kanscale import log
from kanscale.errors import ConfigError
from kanscale.files import find_file, read_json, read_mapping
from kanscale.machine import cpu_model

logger = log.get(__name__)

GiB = 2**30
# how far commbench's straight-line fits miss its own measurements (rel. rms, docs/projection.md)
MEASURED_LINK_SPREAD = 0.3


@dataclass(frozen=True)
class ClusterFile:
    """A cluster file, read and checked before anything is measured."""

    path: Path
    doc: dict[str, Any]
    network: pj.Network
    memory_per_rank: float
    memory_source: str
    host_us: tuple[float, float, float] | None = None  # per kernel: value, low, high
    bandwidth: float = 0.0  # device memory, bytes/s

    def device(self, precision: str, host_us: float | None = None) -> Device:
        """The per-op costs at the training's precision (bf16/fp16 at ``device_tflops_bf16`` where
        stated, else the fp32 ``device_tflops``)."""
        assert self.host_us is not None
        key = "device_tflops_bf16" if precision != "fp32" and "device_tflops_bf16" in self.doc else "device_tflops"
        return Device((host_us or self.host_us[0]) * 1e-6, float(self.doc[key]) * 1e12, self.bandwidth)

    @property
    def ranks_per_node(self) -> int:
        return self.network.ranks_per_node


def read_cluster(path: str, memory: float | None) -> ClusterFile:
    """The cluster file's links and its device memory (``device_memory_GiB``, required unless
    ``--memory-per-device`` gives it), each problem named with its key and fix."""
    file = find_file(path, "--cluster", "cluster file")
    doc = read_mapping(file, "--cluster")
    try:
        network = pj.network_from_cluster(doc, str(file))
    except ValueError as err:
        raise ConfigError(f"--cluster: {file}: {err}") from None
    if memory is not None:
        return ClusterFile(file, doc, network, memory, "--memory-per-device")
    per_device = (
        stated(
            doc,
            "device_memory_GiB",
            file,
            "the memory of one device (GPU), e.g. device_memory_GiB: 40, or give --memory-per-device",
        )
        * GiB
    )
    if "device_tflops" in doc:
        stated(doc, "device_tflops", file, "the training's achieved rate per device in TFLOP/s")
    if "device_tflops_bf16" in doc:
        stated(doc, "device_tflops_bf16", file, "the achieved rate per device in bf16/fp16, TFLOP/s")
    if "host_us_per_kernel" not in doc:
        return ClusterFile(file, doc, network, per_device, f"device_memory_GiB in {file}")
    host = uncertain(doc, "host_us_per_kernel", file)
    what = "{} needs it beside host_us_per_kernel: the device's {}, e.g. {}: {}"
    for key, example in (
        ("memory_bandwidth_GBps", "memory bandwidth in 1e9 bytes/s"),
        ("device_tflops", "achieved FP32 rate"),
    ):
        stated(doc, key, file, what.format("the per-op step time", example, key, 1555 if "GBps" in key else 13))
    bandwidth = float(doc["memory_bandwidth_GBps"]) * 1e9
    return ClusterFile(file, doc, network, per_device, f"device_memory_GiB in {file}", host, bandwidth)


def uncertain(doc: dict[str, Any], key: str, file: Path) -> tuple[float, float, float]:
    """A number, or ``{value: V, low: L, high: H}`` with 0 < L <= V <= H: its value and range."""
    raw = doc[key]
    fix = f"give {key} as a positive number or as {{value: 15, low: 8, high: 25}} (0 < low <= value <= high)"
    if isinstance(raw, dict):
        parts = [raw.get(k) for k in ("value", "low", "high")]
        if set(raw) == {"value", "low", "high"} and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in parts
        ):
            value, low, high = (float(v) for v in parts)  # type: ignore[arg-type]
            if 0 < low <= value <= high:
                return value, low, high
    elif isinstance(raw, (int, float)) and not isinstance(raw, bool) and raw > 0:
        return float(raw), float(raw), float(raw)
    raise ConfigError(f"--cluster: {file}: {key} is {raw!r}; {fix}")


def cluster_target(
    cluster: ClusterFile,
    nodes: int | None,
    ranks_per_node: int | None,
    train_flops_per_sample: float,
    profile: pj.ComputeProfile,
    step: StepOps | None = None,
    precision: str = "fp32",
) -> Target:
    """A cluster file's target. With a per-kernel host cost (``host_us_per_kernel``) the step's
    counted ops set the compute (device_profile; the profile is then not scaled); else its
    compute rate (``device_tflops``) turns the profile's compute into the target's, else the
    profile's compute is taken as the target's."""
    file, doc = cluster.path, cluster.doc
    notes = [f"device memory: {cluster.memory_per_rank / GiB:.1f} GiB per rank ({cluster.memory_source})"]
    scale = 1.0
    if step is not None and cluster.host_us is not None:
        notes += device_notes(cluster, step, precision)
    elif "device_tflops" in doc:
        rate = float(doc["device_tflops"]) * 1e12
        scale = train_flops_per_sample * profile.samples / rate / profile.compute_s
        notes.append(
            f"compute: 6 x parameters FLOP per sample at {rate / 1e12:g} TFLOP/s (device_tflops in {file}): "
            f"x{scale:.3g} the profile's, estimated"
        )
    else:
        notes.append(f"compute: as measured here ({profile.source}); {file} states no device_tflops")
    notes.append(
        "memory on the device: what the allocator holds (no runtime, CUDA context or fragmentation); offloaded "
        "state in host memory"
    )
    if scale != 1.0 or cluster.host_us is None:
        notes.append(
            "bookkeeping measured on this CPU (a strategy's 1-rank step less data and compute: copies, hooks, "
            "Python) carried over unchanged: a GPU runs its copies faster, so where it outweighs the compute the "
            "order between strategies is uncertain"
        )
    return Target(
        name=str(doc.get("name", file.stem)),
        nodes=nodes or 1,
        ranks_per_node=ranks_per_node or cluster.ranks_per_node,
        memory_per_rank=cluster.memory_per_rank,
        network=cluster.network,
        compute_scale=scale,
        offload_on_device=False,
        notes=tuple(notes),
    )


def device_profile(
    cluster: ClusterFile, step: StepOps, profile: pj.ComputeProfile, precision: str
) -> pj.ComputeProfile:
    """The compute of one rank's step on the cluster's device, from the counted ops
    (analysis/projection/device_time.py); of the profile measured here only the data time, host
    work a GPU rank does too, is kept; a strategy's bookkeeping measured on this CPU is not."""
    device = cluster.device(precision)
    t = device_time(step.ops, device)
    work = t.phase_s("forward", "backward")
    return pj.ComputeProfile(
        source=f"{t.kernels} kernels per step counted here, at {device.host_s_per_kernel * 1e6:g} us "
        f"each at least ({t.bound}-bound, estimated)",
        samples=step.micro_batch,
        compute_s=work,
        optimizer_s=t.phase_s("optimizer"),
        data_s=profile.data_s,
        forward_fraction=t.phase_s("forward") / work if work else 1 / 3,
        forward_source="counted",
    )


def device_notes(cluster: ClusterFile, step: StepOps, precision: str) -> list[str]:
    """What the per-op step time assumes, and the step at the low and high per-kernel cost."""
    assert cluster.host_us is not None
    file = cluster.path
    value, low, high = cluster.host_us
    device = cluster.device(precision)
    t = device_time(step.ops, device)
    share = t.by_bound[t.bound] / t.step_s
    rate = "device_tflops_bf16" if device.flops_per_s != float(cluster.doc["device_tflops"]) * 1e12 else "device_tflops"
    span = " to ".join(f"{device_time(step.ops, cluster.device(precision, h)).step_s * 1e3:.3g}" for h in (low, high))
    return [
        f"compute on the device: {step.kernels} kernels per step of {step.micro_batch} samples (aten ops counted here, "
        f"views left out), each max({value:g} us host dispatch and launch (host_us_per_kernel in {file}), FLOPs at "
        f"{device.flops_per_s / 1e12:g} TFLOP/s ({rate} in {file}), bytes at {device.bytes_per_s / 1e9:g} GB/s "
        f"(memory_bandwidth_GBps)); estimated",
        f"bound of the compute: {t.bound} ({share:.0%} of {t.step_s * 1e3:.3g} ms per step); at {low:g} to {high:g} us "
        f"per kernel the step takes {span} ms (estimated)",
        "bookkeeping measured on this CPU (a strategy's 1-rank step less data and compute) not carried over: on a GPU "
        "its copies are kernels this count does not hold (DDP's bucket copies); the data time measured here is kept "
        "(host work a GPU rank does too)",
    ]


def stated(doc: dict[str, Any], key: str, file: Path, what: str) -> float:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(
            f"--cluster: {file} has no {key} ({what}); add it to the file"
            if value is None
            else f"--cluster: {file}: {key} must be a positive number, got {value!r}"
        )
    return float(value)


def this_machine(
    ranks_per_node: int, memory: float | None, networks: list[str] | None, out: Path, contention: float
) -> Target:
    """This machine at ``ranks_per_node`` ranks: its memory shared by the ranks (or
    ``--memory-per-device``), and its links from commbench files or measured now."""
    ram = ram_bytes()
    per_rank = memory_here(ranks_per_node, memory)
    files = networks or [str(measure_links(ranks_per_node, out))]
    docs = [read_json(f, "--network") for f in files]
    try:
        network = pj.network_from_commbench(docs, ", ".join(files))
    except (ValueError, KeyError) as err:
        raise ConfigError(f"--network: {err}") from None
    notes = [
        f"memory: {per_rank / GiB:.2f} GiB per rank ("
        + ("--memory-per-device" if memory is not None else f"{ram / GiB:.1f} GiB of RAM over {ranks_per_node} ranks")
        + "); a rank's peak is its resident set, as the records measure it",
        f"compute: as measured here, x{contention:g} when ranks share the machine (--contention)",
    ]
    return Target(
        name=f"this machine ({cpu_model()}, {os.cpu_count()} cores)",
        nodes=1,
        ranks_per_node=ranks_per_node,
        memory_per_rank=per_rank,
        network=network,
        contention=contention,
        offload_on_device=True,
        comm_spread=MEASURED_LINK_SPREAD,
        notes=tuple(notes),
    )


def ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_here(ranks_per_node: int, memory: float | None) -> float:
    """A rank's memory on this machine: ``--memory-per-device``, else the RAM over the ranks."""
    return memory if memory is not None else ram_bytes() / ranks_per_node


def measure_links(ranks: int, out: Path) -> Path:
    """This machine's links, measured by ``kanscale commbench`` (a short run: up to 16 MiB, 5
    iterations) into ``OUT/commbench.json``; a file already there is reused."""
    path = out / "commbench.json"
    if path.exists():
        return path
    out.mkdir(parents=True, exist_ok=True)
    logger.info(f"[recommend] measuring this machine's links: kanscale commbench --nproc-per-node {ranks} (about 10 s)")
    command = [
        sys.executable,
        "-m",
        "launchers.cli",
        "commbench",
        "--nproc-per-node",
        str(ranks),
        "--max-bytes",
        str(16 * 2**20),
        "--iters",
        "5",
        "--warmup",
        "2",
        "--out",
        str(path),
    ]
    if ranks > (os.cpu_count() or 1):
        command.append("--oversubscribe")
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise ConfigError(
            f"--network: measuring this machine's links failed (kanscale commbench exit "
            f"{done.returncode}: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ''}); "
            "give commbench results with --network FILE"
        )
    return path
