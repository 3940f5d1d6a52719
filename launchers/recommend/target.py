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
    return ClusterFile(file, doc, network, per_device, f"device_memory_GiB in {file}")


def cluster_target(
    cluster: ClusterFile,
    nodes: int | None,
    ranks_per_node: int | None,
    train_flops_per_sample: float,
    profile: pj.ComputeProfile,
) -> Target:
    """A cluster file's target. Its compute rate (``device_tflops``, achieved in the training's
    precision) turns the profile's compute into the target's, else the profile's compute is
    taken as the target's."""
    file, doc = cluster.path, cluster.doc
    notes = [f"device memory: {cluster.memory_per_rank / GiB:.1f} GiB per rank ({cluster.memory_source})"]
    if "device_tflops" in doc:
        rate = float(doc["device_tflops"]) * 1e12
        scale = train_flops_per_sample * profile.samples / rate / profile.compute_s
        notes.append(
            f"compute: 6 x parameters FLOP per sample at {rate / 1e12:g} TFLOP/s (device_tflops in {file}): "
            f"x{scale:.3g} the profile's, estimated"
        )
    else:
        scale = 1.0
        notes.append(f"compute: as measured here ({profile.source}); {file} states no device_tflops")
    notes.append(
        "memory on the device: what the allocator holds (no runtime, CUDA context or fragmentation); offloaded "
        "state in host memory"
    )
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
