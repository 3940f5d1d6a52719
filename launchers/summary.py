"""The one-screen summary ``kanscale train`` prints at the end of a run."""

from __future__ import annotations

from pathlib import Path

from analysis.records.schema import RunRecord
from analysis.report.format import human_bytes


def overhead(record: RunRecord) -> str:
    """The step's share beyond compute, named for what it is: communication (and the backend's own
    work) where there are several ranks; with one process there is no communication to name."""
    what = "comm overhead" if record.topology.world_size > 1 else "overhead beyond compute (1 process: no comm)"
    if record.comm_overhead is None:
        return f"{what} not measured"
    return f"{what} {100 * record.comm_overhead:.1f}%"


def format_summary(record: RunRecord, run_dir: Path) -> str:
    r = record
    m, b, topo = r.model, r.batch, r.topology
    # Data-parallel ranks, from the record's own batch: the world size but under tensor parallelism.
    shares = max(1, b.global_batch // max(1, b.micro_batch * b.grad_accum))
    split = (
        f"{shares} data-parallel rank(s) of {topo.world_size // shares} tensor-parallel ranks each"
        if shares != topo.world_size
        else f"{topo.world_size} ranks"
    )
    lines = [
        f"run        {r.run_id}  [{r.status}]",
        f"model      {m.family} {m.widths}"
        + "".join(f" {k}={v}" for k, v in (("grid", m.grid), ("k", m.order)) if v is not None)
        + f"  {m.params_trainable:,} trainable / {m.params_total:,} total params",
        f"task       {r.task.label or r.task.name}  {r.task.n_train:,} train / {r.task.n_test:,} test samples",
        f"strategy   {r.strategy.label} on {topo.world_size} rank(s) x {topo.nodes} node(s), {topo.device_type} "
        f"({topo.device_name}), launcher {topo.launcher}",
        f"training   {b.steps} steps = {b.epochs:g} epochs, global batch {b.global_batch} "
        f"(micro {b.micro_batch} x accum {b.grad_accum} x {split}), {b.timed_steps} timed",
    ]
    p = r.precision
    if p.setting != "fp32" or p.compute_dtype not in (None, "float32", "float64"):
        asked = {"bf16": "bfloat16", "fp16": "float16"}.get(p.setting)
        lines.append(
            f"precision  {p.setting} by {p.mechanism}: computed in {p.compute_dtype}, parameters {p.param_dtype}, "
            f"optimizer on {p.optimizer_dtype}"
            + (
                f" (NOT {asked}: the model's operations are ones {p.mechanism} leaves in full precision)"
                if asked and p.compute_dtype and asked not in p.compute_dtype
                else ""
            )
        )
    if r.compile is not None and r.compile.setting != "none":
        breaks = r.compile.graph_breaks
        lines.append(
            f"compile    {r.compile.setting}: {r.compile.mechanism}"
            + (
                ""
                if breaks is None
                else "; one graph per compiled region"
                if not breaks
                else f"; NOT one graph: {len(breaks)} graph break reason(s): {'; '.join(b[:120] for b in breaks[:3])}"
            )
        )
    if r.throughput and r.timings:
        lines.append(
            f"speed      {r.throughput.samples_per_s:,.0f} samples/s "
            f"({r.throughput.samples_per_s_per_rank:,.0f} per rank); "
            f"step p50 {r.timings.step_p50_s * 1e3:.2f} ms, p95 {r.timings.step_p95_s * 1e3:.2f} ms, "
            f"data {r.timings.data_s * 1e3:.2f} ms ({b.loader}"
            + (f", {b.loader_workers} workers" if b.loader == "dataloader" else "")
            + "); "
            + overhead(r)
            + (f"; compiling {r.timings.compile_s:.1f} s (not in step times)" if r.timings.compile_s else "")
        )
        if r.comm:
            lines.append(f"comm       {r.comm.note}")
    if r.memory:
        ms = r.memory.model_state
        lines.append(
            f"memory     peak RSS {human_bytes(r.memory.peak_rss_bytes)}"
            + (
                f", peak device {human_bytes(r.memory.peak_device_bytes)}"
                if r.memory.peak_device_bytes is not None
                else ""
            )
            + f"; model state per rank: params {human_bytes(ms.params)}, grads {human_bytes(ms.grads)}, "
            f"optimizer {human_bytes(ms.optimizer)}"
            + (f", fp32 master copy {human_bytes(ms.master_params)}" if ms.master_params else "")
        )
    if r.final_loss is not None:
        scores = "".join(f"   test {name} {value:.4e}" for name, value in (r.test_metrics or {}).items())
        lines.append(f"loss       final train {r.final_loss:.4e}{scores}")
    if r.error:
        lines.append(f"error      {r.error.type} on rank {r.error.rank} after step {r.error.step}: {r.error.message}")
    lines.append(f"record     {run_dir / 'summary.json'}")
    return "\n".join(lines)
