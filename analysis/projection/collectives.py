"""What a collective costs: nccl-tests' bandwidth definitions, the alpha-beta fit of measured
times, and the links a projection runs over (from ``kanscale commbench`` results or a cluster
file).

Cost of one collective of S bytes (the full buffer, as nccl-tests counts it) over P ranks on a
link with per-step latency alpha and inverse bus bandwidth beta (a ring; nccl-tests'
doc/PERFORMANCE.md for the factors):

    all-reduce          2 (P - 1) alpha + 2 (P - 1) / P * S * beta
    reduce-scatter        (P - 1) alpha +   (P - 1) / P * S * beta
    all-gather            (P - 1) alpha +   (P - 1) / P * S * beta

Ranks spanning several nodes form one flat ring whose every step waits for its slowest hop, the
inter-node one, so the inter-node alpha and beta apply to the whole collective; with several NICs
per node, several such rings share the bytes (Network.collective_s).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from analysis.projection.uncertainty import stated

MiB = 1 << 20
OPS = ("all_reduce", "reduce_scatter", "all_gather")
HOST_COPY = "host_copy"  # commbench's per-rank host copy: the link ZeRO's offload uses


def busbw_factor(op: str, ranks: int) -> float:
    """nccl-tests' correction from algorithm to bus bandwidth: busbw = algbw * factor."""
    if op == "all_reduce":
        return 2 * (ranks - 1) / ranks
    if op in ("reduce_scatter", "all_gather"):
        return (ranks - 1) / ranks
    if op == HOST_COPY:
        return 1.0
    raise ValueError(f"unknown operation {op!r}; expected one of {', '.join((*OPS, HOST_COPY))}")


def ring_steps(op: str, ranks: int) -> int:
    """Latency-bound steps of a ring: each pays one link latency."""
    if op == HOST_COPY:
        return 1
    return 2 * (ranks - 1) if op == "all_reduce" else ranks - 1


@dataclass(frozen=True)
class Fit:
    """time = alpha + beta * bytes for one operation at the measured rank count."""

    alpha_s: float
    beta_s_per_byte: float
    rel_rms: float  # root mean square of the relative residuals

    def seconds(self, nbytes: float) -> float:
        return self.alpha_s + self.beta_s_per_byte * nbytes


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float]) -> Fit:
    """Least squares of time = alpha + beta * bytes on relative residuals (each point weighted by
    1 / its time). Message sizes span six orders of magnitude: unweighted, the largest messages
    alone would set both parameters and alpha, visible only at small sizes, would be noise.
    Neither may be negative; one that comes out negative is fixed at 0 and the other refitted."""
    s, t = np.asarray(nbytes, dtype=float), np.asarray(seconds, dtype=float)
    if len(np.unique(s)) < 2 or np.any(t <= 0):
        raise ValueError("fitting alpha and beta needs at least two message sizes with positive times")

    def solve(*columns: np.ndarray) -> np.ndarray:
        return np.linalg.lstsq(np.stack(columns, axis=1) / t[:, None], np.ones_like(t), rcond=None)[0]

    alpha, beta = solve(np.ones_like(s), s)
    if alpha < 0:
        alpha, beta = 0.0, solve(s)[0]
    elif beta < 0:
        alpha, beta = solve(np.ones_like(s))[0], 0.0
    residual = (alpha + beta * s - t) / t
    return Fit(float(alpha), float(beta), float(np.sqrt(np.mean(residual**2))))


@dataclass(frozen=True)
class LinkCost:
    """One link as the ring model sees it: latency per ring step, inverse bus bandwidth."""

    alpha_s: float
    beta_s_per_byte: float

    @classmethod
    def from_fit(cls, op: str, fit: Fit, ranks: int) -> LinkCost:
        """The link behind an operation's fit at ``ranks``: alpha over the ring's steps, beta over
        the bus-bandwidth factor (so 1 / beta is the bus bandwidth)."""
        return cls(fit.alpha_s / ring_steps(op, ranks), fit.beta_s_per_byte / busbw_factor(op, ranks))

    def seconds(self, op: str, nbytes: float, ranks: int) -> float:
        if ranks <= 1 and op != HOST_COPY:
            return 0.0
        return ring_steps(op, ranks) * self.alpha_s + busbw_factor(op, ranks) * nbytes * self.beta_s_per_byte


@dataclass(frozen=True)
class Network:
    """Link costs by (link, operation); link is intra, inter or host, operation one of OPS,
    host_copy, or ``any`` (a cluster file gives one cost per link)."""

    source: str
    links: dict[tuple[str, str], LinkCost]
    ranks_per_node: int
    overlap: bool  # can collectives run while the rank computes (GPU streams), or not (CPU ranks)
    host_optimizer_slowdown: float = 1.0  # offloaded optimizer step on the host vs on the device
    inter_nics: int = 1  # NICs per node on the inter-node link; its LinkCost is one NIC's

    def cost(self, link: str, op: str) -> LinkCost:
        found = self.links.get((link, op)) or self.links.get((link, "any"))
        if found is None:
            have = sorted({name for name, _ in self.links})
            raise ValueError(
                f"no {link} link in {self.source} (it has: {', '.join(have)}); "
                + (
                    "run kanscale commbench --nnodes 2 for an inter-node one and pass both files"
                    if link == "inter"
                    else "measure it with kanscale commbench or give a cluster file"
                )
            )
        return found

    def has(self, link: str) -> bool:
        return any(name == link for name, _ in self.links)

    def collective_s(self, op: str, nbytes: float, ranks: int, nodes: int) -> float:
        """One collective over ``ranks`` ranks on ``nodes`` nodes. Across nodes with several NICs
        per node, NCCL runs one ring per NIC (each rank on its nearest NIC, rail-aligned), each
        moving its share of the bytes: the bandwidth is one NIC's times the NICs that the
        collective's ranks on a node can drive, at most one each; the latency per step is one
        NIC's."""
        if ranks <= 1:
            return 0.0
        if nodes <= 1:
            return self.cost("intra", op).seconds(op, nbytes, ranks)
        lanes = min(self.inter_nics, math.ceil(ranks / nodes))
        return self.cost("inter", op).seconds(op, nbytes / lanes, ranks)  # each ring moves 1 / lanes of the bytes

    def host_s(self, nbytes: float) -> float:
        return self.cost("host", HOST_COPY).seconds(HOST_COPY, nbytes, 1)


def network_from_commbench(docs: Sequence[dict[str, Any]], source: str) -> Network:
    """Link costs from one or more ``kanscale commbench`` JSON documents (e.g. one intra-node and
    one inter-node run). Ranks per node: the largest any of them ran."""
    links = {}
    for doc in docs:
        if doc.get("kind") != "kanscale commbench":
            raise ValueError('not a kanscale commbench JSON (no "kind": "kanscale commbench")')
        for fit in doc["fits"]:
            links[(fit["link"], fit["op"])] = LinkCost(fit["link_alpha_s"], fit["link_beta_s_per_byte"])
    return Network(
        source=source,
        links=links,
        ranks_per_node=max(d["ranks_per_node"] for d in docs),
        overlap=all(d["device"] == "cuda" for d in docs),
    )


def network_from_cluster(doc: dict[str, Any], source: str, end: str = "value") -> Network:
    """A cluster description (configs/clusters/*.yaml): per link alpha_us (latency per ring step)
    and busbw_GBps (bus bandwidth, 1e9 bytes/s); the inter-node link may instead state
    ``nics_per_node`` and ``busbw_GBps_per_nic``; the host link and the offloaded optimizer's
    slowdown; ranks per node; whether collectives overlap compute. Each number may carry its
    range (analysis/projection/uncertainty.py): the network is read at ``end`` of ENDS."""
    try:
        links, nics = {}, 1
        for name, v in doc["links"].items():
            alpha = stated(v["alpha_us"], f"links.{name}.alpha_us").at(end, "high")
            if name == "inter" and ("nics_per_node" in v or "busbw_GBps_per_nic" in v):
                nics = nic_count(v)
                busbw = stated(v.get("busbw_GBps_per_nic"), "links.inter.busbw_GBps_per_nic").at(end, "low")
            else:
                busbw = stated(v["busbw_GBps"], f"links.{name}.busbw_GBps").at(end, "low")
            links[(name, "any")] = LinkCost(alpha * 1e-6, 1 / (busbw * 1e9))
        slowdown = doc.get("host_optimizer_slowdown", 1.0)
        return Network(
            source=source,
            links=links,
            ranks_per_node=count(doc["ranks_per_node"], "ranks_per_node"),
            overlap=bool(doc["overlap"]),
            host_optimizer_slowdown=stated(slowdown, "host_optimizer_slowdown").at(end, "high"),
            inter_nics=nics,
        )
    except (KeyError, TypeError, AttributeError) as err:
        raise ValueError(
            f"needs ranks_per_node, overlap and links: {{intra|inter|host: {{alpha_us, busbw_GBps}}}} "
            f"(see configs/clusters/a100_ib.yaml); problem at {err!s}"
        ) from None


def nic_count(link: dict[str, Any]) -> int:
    """The inter-node link's NICs per node: stated with a bandwidth per NIC, never beside the
    node's one ``busbw_GBps`` (which would say the bandwidth twice)."""
    if "busbw_GBps" in link:
        raise ValueError(
            "links.inter.nics_per_node and links.inter.busbw_GBps_per_nic are stated beside links.inter.busbw_GBps; "
            "give busbw_GBps alone (one NIC per node) or nics_per_node with busbw_GBps_per_nic"
        )
    if "busbw_GBps_per_nic" not in link:
        raise ValueError("links.inter.nics_per_node needs links.inter.busbw_GBps_per_nic, one NIC's bus bandwidth")
    return count(link.get("nics_per_node", 1), "links.inter.nics_per_node")


def count(raw: Any, key: str) -> int:
    """A whole count of at least 1 (ranks, NICs): no range, it is a fact of the hardware."""
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
        raise ValueError(f"{key} is {raw!r}; give a whole number, 1 or more")
    return raw
