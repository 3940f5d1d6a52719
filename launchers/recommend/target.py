"""Where ``kanscale recommend`` places the training: a cluster file's nodes (their device memory,
links and compute rate, all stated), or this machine (its memory, and its links measured now with
``kanscale commbench`` unless commbench files are given). Every input problem is a ConfigError
naming the flag or the file's key and the fix."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from analysis import projection as pj
from analysis.projection.advice import End, Target
from analysis.projection.cluster_file import check_cluster, layout_needs
from analysis.projection.device_time import Device, StepOps, device_time
from analysis.projection.shared_cores import shared_cores_at
from analysis.projection.uncertainty import ENDS, Stated, ranges, stated
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
    """A cluster file, read and checked before anything is measured: its network at every end of
    ENDS (each input at its stated value, its pessimistic and its optimistic end)."""

    path: Path
    doc: dict[str, Any]
    networks: dict[str, pj.Network]
    memory_per_rank: float
    memory_source: str
    numbers: dict[str, Stated]  # the device's stated numbers by key

    @property
    def network(self) -> pj.Network:
        return self.networks["value"]

    @property
    def per_kernel(self) -> bool:
        """Whether the file states what one kernel costs (the step is then its counted ops)."""
        return "host_us_per_kernel" in self.numbers

    def rate_key(self, precision: str) -> str:
        """The achieved rate at the training's precision: bf16/fp16 at ``device_tflops_bf16`` where
        stated, else the fp32 ``device_tflops``."""
        return "device_tflops_bf16" if precision != "fp32" and "device_tflops_bf16" in self.numbers else "device_tflops"

    def device(self, precision: str, end: str = "value") -> Device:
        """The per-op costs at the training's precision, every number at ``end`` of ENDS."""
        n = self.numbers
        return Device(
            n["host_us_per_kernel"].at(end, "high") * 1e-6,
            n[self.rate_key(precision)].at(end, "low") * 1e12,
            n["memory_bandwidth_GBps"].at(end, "low") * 1e9,
        )

    @property
    def ranks_per_node(self) -> int:
        return self.network.ranks_per_node


def read_cluster(path: str, memory: float | None, nodes: int = 1, ranks_per_node: int | None = None) -> ClusterFile:
    """The cluster file's links and its device memory (``device_memory_GiB``, required unless
    ``--memory-per-device`` gives it), the whole file checked first (every problem in one
    refusal, each with its fix: analysis/projection/cluster_file.py) for ``nodes`` nodes of
    ``ranks_per_node`` ranks (default: the file's)."""
    file = find_file(path, "--cluster", "cluster file")
    doc = read_mapping(file, "--cluster")
    per_node = ranks_per_node or doc.get("ranks_per_node")
    needs = layout_needs(nodes, per_node if isinstance(per_node, int) else 1, False, memory is not None)
    check_cluster(doc, file, needs)
    try:
        networks = {end: pj.network_from_cluster(doc, str(file), end) for end in ENDS}
    except ValueError as err:
        raise ConfigError(f"--cluster: {file}: {err}") from None
    what = {
        "device_memory_GiB": "the memory of one device (GPU), e.g. device_memory_GiB: 40, or give --memory-per-device",
        "device_tflops": "the training's achieved rate per device in TFLOP/s",
        "device_tflops_bf16": "the achieved rate per device in bf16/fp16, TFLOP/s",
        "host_us_per_kernel": "what the host spends issuing one kernel, in microseconds",
        "memory_bandwidth_GBps": "the device's memory bandwidth in 1e9 bytes/s",
    }
    numbers = {key: number(doc, key, file, what[key]) for key in what if key in doc}
    if memory is None:
        number(doc, "device_memory_GiB", file, what["device_memory_GiB"])
    if "host_us_per_kernel" in numbers:
        for key in ("memory_bandwidth_GBps", "device_tflops"):
            number(doc, key, file, what[key] + "; the per-op step time needs it beside host_us_per_kernel")
    if memory is not None:
        return ClusterFile(file, doc, networks, memory, "--memory-per-device", numbers)
    # what fits is decided at the stated value (a range on the memory is accepted, not propagated)
    per_device = numbers["device_memory_GiB"].value * GiB
    return ClusterFile(file, doc, networks, per_device, f"device_memory_GiB in {file}", numbers)


def number(doc: dict[str, Any], key: str, file: Path, what: str) -> Stated:
    """A device number of the file: positive, or ``{value, low, high}``."""
    if key not in doc:
        raise ConfigError(f"--cluster: {file} has no {key} ({what}); add it to the file")
    try:
        return stated(doc[key], key)
    except ValueError as err:
        raise ConfigError(f"--cluster: {file}: {err}") from None


def cluster_target(
    cluster: ClusterFile,
    nodes: int | None,
    ranks_per_node: int | None,
    train_flops_per_sample: float,
    reference: dict[str, pj.ComputeProfile],
    step: StepOps | None = None,
    precision: str = "fp32",
    spread: float = 0.0,
) -> Target:
    """A cluster file's target at every end of ENDS. With a per-kernel host cost
    (``host_us_per_kernel``) the step's counted ops set the compute (device_profile; the profile
    is then not scaled); else its compute rate (``device_tflops``) turns the reference profile's
    compute (by end) into the target's, else the profile's compute is taken as the target's."""
    file, doc = cluster.path, cluster.doc
    notes = [f"device memory: {cluster.memory_per_rank / GiB:.1f} GiB per rank ({cluster.memory_source})"]
    scales = dict.fromkeys(ENDS, 1.0)
    bounds = {"compute": 1.0}
    measured = ""
    if step is not None and cluster.per_kernel:
        notes += device_notes(cluster, step, precision)
        bounds = device_time(step.ops, cluster.device(precision)).shares
    elif "device_tflops" in cluster.numbers:
        rate = cluster.numbers["device_tflops"]
        samples = train_flops_per_sample * reference["value"].samples
        scales = {end: samples / (rate.at(end, "low") * 1e12) / reference[end].compute_s for end in ENDS}
        notes.append(
            f"compute: 6 x parameters FLOP per sample at {rate.value:g} TFLOP/s (device_tflops in {file}): "
            f"x{scales['value']:.3g} the profile's, estimated"
        )
        measured = "data time and bookkeeping"
    else:
        notes.append(f"compute: as measured here ({reference['value'].source}); {file} states no device_tflops")
        measured = "compute, data time and bookkeeping"
    notes.append(
        "memory on the device: what the allocator holds (no runtime, CUDA context or fragmentation); offloaded "
        "state in host memory"
    )
    if not (step is not None and cluster.per_kernel):
        notes.append(
            "bookkeeping measured on this CPU (a strategy's 1-rank step less data and compute: copies, hooks, "
            "Python) carried over unchanged: a GPU runs its copies faster, so where it outweighs the compute the "
            "order between strategies is uncertain"
        )
    stated_ranges = ", ".join(ranges(doc)) or "none (every number is stated without a range)"
    here = (
        f"measured here ({measured}): +-{spread:.0%}, the 1-rank probes' spread between timing windows"
        if measured
        else "nothing timed here"
    )
    interval = (
        f"interval: the predicted rate with every input at its pessimistic end and at its optimistic end; "
        f"ranges stated in {file}: {stated_ranges}; {here}"
    )
    return Target(
        name=str(doc.get("name", file.stem)),
        nodes=nodes or 1,
        ranks_per_node=ranks_per_node or cluster.ranks_per_node,
        memory_per_rank=cluster.memory_per_rank,
        network=cluster.network,
        compute_scale=scales["value"],
        offload_on_device=False,
        slow=End(cluster.networks["slow"], scales["slow"]),
        fast=End(cluster.networks["fast"], scales["fast"]),
        compute_bounds=bounds,
        interval=interval,
        notes=tuple(notes),
    )


def device_profile(
    cluster: ClusterFile,
    step: StepOps,
    profile: pj.ComputeProfile,
    precision: str,
    end: str = "value",
    per_rank: bool = False,
) -> pj.ComputeProfile:
    """The compute of one rank's step on the cluster's device, from the counted ops
    (analysis/projection/device_time.py), every stated number at ``end`` of ENDS; of ``profile``
    only its data time, host work a GPU rank does too, is kept (none where rehearsed: the batch's
    gather is among the kernels); a strategy's bookkeeping timed on this CPU is not. ``per_rank``:
    ``step`` is one rank's at the target's layout (rehearsed), not the whole model's."""
    device = cluster.device(precision, end)
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
        per_rank=per_rank,
    )


def device_notes(cluster: ClusterFile, step: StepOps, precision: str) -> list[str]:
    """What the per-op step time assumes, and the step with every number at either end of its range."""
    file, n = cluster.path, cluster.numbers
    device = cluster.device(precision)
    t = device_time(step.ops, device)
    share = t.by_bound[t.bound] / t.step_s
    rate = cluster.rate_key(precision)
    span = " to ".join(
        f"{device_time(step.ops, cluster.device(precision, end)).step_s * 1e3:.3g}" for end in ("fast", "slow")
    )
    return [
        f"compute on the device: {step.kernels} kernels per step of {step.micro_batch} samples (aten ops counted here, "
        f"views left out), each max({n['host_us_per_kernel'].value:g} us host dispatch and launch (host_us_per_kernel "
        f"in {file}), FLOPs at {device.flops_per_s / 1e12:g} TFLOP/s ({rate} in {file}), bytes at "
        f"{device.bytes_per_s / 1e9:g} GB/s (memory_bandwidth_GBps)); estimated",
        f"bound of the compute: {t.bound} ({share:.0%} of {t.step_s * 1e3:.3g} ms per step); with "
        + ", ".join(n[k].words() for k in ("host_us_per_kernel", rate, "memory_bandwidth_GBps"))
        + f" the step takes {span} ms (estimated)",
        "each strategy's rank: its own step rehearsed at the target's layout (strategies/rehearsal/), the backend's "
        "kernels (DDP's bucket copies, FSDP's flattening, the batch's gather) counted with the model's, each costed "
        "the same way; nothing timed on this CPU is carried over",
    ]


def this_machine(
    ranks_per_node: int,
    memory: float | None,
    networks: list[str] | None,
    out: Path,
    contention: float | None,
    step_compute_s: float,
    spread: float = 0.0,
) -> Target:
    """This machine at ``ranks_per_node`` ranks: its memory shared by the ranks (or
    ``--memory-per-device``), its links from commbench files or measured now, each link's cost
    within the fits' error at the pessimistic and optimistic ends, and its compute at that many
    ranks: ``--contention`` where given, else what commbench measured of ranks sharing the cores
    at ``step_compute_s`` of compute per step, its range the ends."""
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
    ]
    shared = shared_cores_at(docs, step_compute_s) if contention is None and ranks_per_node > 1 else None
    if shared is not None:
        notes.append(shared.words(ranks_per_node, ", ".join(files)))
        factors = {"value": shared.factor, "slow": shared.high, "fast": shared.low}
    else:
        given = 1.0 if contention is None else contention
        why = (
            "--contention"
            if contention is not None
            else "one rank shares nothing"
            if ranks_per_node == 1
            else "assumed: the commbench file does not measure it; delete it to measure again"
        )
        notes.append(f"compute: as measured here, x{given:g} when ranks share the machine ({why})")
        factors = dict.fromkeys(("value", "slow", "fast"), given)
    return Target(
        name=f"this machine ({cpu_model()}, {os.cpu_count()} cores)",
        nodes=1,
        ranks_per_node=ranks_per_node,
        memory_per_rank=per_rank,
        network=network,
        contention=factors["value"],
        offload_on_device=True,
        slow=End(scaled_links(network, 1 + MEASURED_LINK_SPREAD), contention=factors["slow"]),
        fast=End(scaled_links(network, 1 - MEASURED_LINK_SPREAD), contention=factors["fast"]),
        interval=f"interval: the predicted rate with every input at its pessimistic end and at its optimistic end, "
        f"all measured here: compute, data time and bookkeeping +-{spread:.0%} (the 1-rank probes' spread between "
        f"timing windows), every link's cost +-{MEASURED_LINK_SPREAD:.0%} (how far commbench's fits miss its own "
        "measurements), ranks sharing the cores at the ends of the range commbench measured",
        notes=tuple(notes),
    )


def scaled_links(network: pj.Network, factor: float) -> pj.Network:
    """The network with every link's latency and time per byte times ``factor``."""
    links = {k: pj.LinkCost(v.alpha_s * factor, v.beta_s_per_byte * factor) for k, v in network.links.items()}
    return replace(network, links=links)


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
