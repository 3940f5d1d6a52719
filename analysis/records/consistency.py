"""Whether a run record agrees with itself: a record edited by hand, or one whose figures contradict
each other, is kept out of every comparison (analysis/records/load.py lists it, with the reason, among
the report's problems) rather than skewing a speed-up or a ranking."""

from __future__ import annotations

import math

from analysis.records.schema import RunRecord

REL = 1e-6  # what a figure the suite derives from another may differ by: rounding only


def inconsistencies(record: RunRecord) -> list[str]:
    """Each way ``record`` contradicts itself, in words (empty: it agrees with itself)."""
    found = []
    t, b = record.topology, record.batch
    if t.world_size != t.nodes * t.procs_per_node:
        found.append(f"world_size {t.world_size} is not nodes x procs_per_node ({t.nodes} x {t.procs_per_node})")
    if t.mesh:
        ranks = math.prod(t.mesh.values())
        if ranks != t.world_size:
            found.append(f"its mesh {t.mesh} holds {ranks} ranks, its world_size is {t.world_size}")
        replicas = t.world_size // max(1, t.mesh.get("tp", 1))
        if b.global_batch != b.micro_batch * b.grad_accum * replicas:
            found.append(
                f"global_batch {b.global_batch} is not micro_batch x grad_accum x data-parallel ranks "
                f"({b.micro_batch} x {b.grad_accum} x {replicas})"
            )
    rate = record.throughput
    if rate is not None and not math.isclose(
        rate.samples_per_s, rate.samples_per_s_per_rank * t.world_size, rel_tol=REL, abs_tol=1e-9
    ):
        found.append(
            f"samples_per_s {rate.samples_per_s:g} is not samples_per_s_per_rank x world_size "
            f"({rate.samples_per_s_per_rank:g} x {t.world_size})"
        )
    return found
