"""A projection as the suite writes it: its assumptions in words, the table, the Markdown
(labelled projected) and the JSON document."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import pandas as pd

from analysis.projection.collectives import Network
from analysis.projection.inputs import ComputeProfile, ModelShape
from analysis.projection.step_model import Projection
from analysis.report.format import human_bytes
from analysis.report.tables import count, fixed, percent


def assumptions(
    shape: ModelShape,
    profiles: dict[str, ComputeProfile],
    net: Network,
    compute_scale: float,
    contention: float,
    probe: bool,
    memory: str = "activations not counted",
) -> list[str]:
    any_profile = next(iter(profiles.values()))
    forward = f"{any_profile.forward_source} {any_profile.forward_fraction:.2f}"
    return [
        f"model: {shape.label}, {shape.trainable:,} trainable parameters, {shape.precision}, Adam; {memory}",
        "compute: "
        + "; ".join(sorted({p.source for p in profiles.values()}))
        + f"; linear in samples per rank; x{compute_scale:g}"
        + (f", x{contention:.3g} more when P > 1" if contention != 1 else "")
        + f"; forward share {forward}",
        f"network: {net.source}; a flat ring, inter-node alpha/beta whenever the ranks span nodes",
        "overlap: "
        + (
            "DDP buckets and FSDP reduce-scatters beside backward, FSDP gathers prefetched; DeepSpeed's "
            "collectives block (overlap_comm off)"
            if net.overlap
            else "none: collectives and compute add up (CPU ranks)"
        ),
        (
            "1-rank bookkeeping (step - data - compute of a strategy's own 1-rank run) carried over unchanged"
            if any(p.overhead_s for p in profiles.values())
            else "no 1-rank bookkeeping carried over"
        ),
        "published probe: +1 forward and +1/2 all-reduce per gradient tensor per step when P > 1"
        if probe
        else "no probe",
    ]


def table(rows: Sequence[Projection]) -> pd.DataFrame:
    """The projection as text, the suite's table conventions."""
    ms = fixed(2)
    text = pd.DataFrame(
        [
            {
                "strategy": r.strategy,
                "nodes x ranks": f"{r.nodes}x{math.ceil(r.ranks / r.nodes)}",
                "samples / rank": count(r.samples_per_rank),
                "step ms": ms(1e3 * r.step_s),
                "compute ms": ms(1e3 * r.compute_s),
                "exposed comm ms": ms(1e3 * r.exposed_s),
                "comm fraction": percent(r.comm_fraction),
                "samples / s": count(r.samples_per_s),
                "speedup": fixed(2)(r.speedup),
                "efficiency": percent(r.efficiency),
                "model state / rank": human_bytes(r.state_bytes),
                "of it on host": human_bytes(r.host_bytes) if r.host_bytes else "",
            }
            for r in rows
        ]
    )
    if any(r.probe_overhead is not None for r in rows):
        text["probe's (t2 - t1) / t2"] = [
            percent(r.probe_overhead) if r.probe_overhead is not None else "" for r in rows
        ]
    return text


def markdown(rows: Sequence[Projection], notes: Sequence[str], takeovers: dict[str, int | None], limit: int) -> str:
    """The projected table with its assumptions and where communication takes over."""
    if any(r.tp > 1 for r in rows):
        notes = [
            *notes,
            "tensor parallelism (the pairs plan, every width divisible): compute and model state divided "
            "by the TP degree; samples / rank is per model replica, which its TP ranks share, so compare "
            "samples / s",
        ]
    lines = ["**Projected** (a model, not a measurement). Assumptions:", ""] + [f"- {n}" for n in notes] + [""]
    lines.append(table(rows).to_markdown(index=False))
    lines += [
        "",
        f"Projected rank count at which communication takes over (exposed communication > compute; powers of "
        f"two up to {limit}): " + ", ".join(f"{s} {p if p else f'> {limit}'}" for s, p in takeovers.items()),
    ]
    return "\n".join(lines) + "\n"


def document(rows: Sequence[Projection], notes: Sequence[str], takeovers: dict[str, int | None]) -> dict[str, Any]:
    return {
        "kind": "kanscale projection",
        "projected": True,
        "assumptions": list(notes),
        "takeover_ranks": takeovers,
        "rows": [
            {
                **asdict(r),
                "comm_fraction": r.comm_fraction,
                "state_bytes": r.state_bytes,
                "samples_per_s": r.samples_per_s,
            }
            for r in rows
        ],
    }
