"""A recommendation as ``kanscale recommend`` prints it (the ranked table, the pick's command,
what was left out, every assumption) and as ``--json`` writes it."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from analysis.projection.advice import Candidate
from analysis.report.documents import write_json_and_markdown
from analysis.report.format import human_bytes
from kanscale import log
from kanscale.writes import atomic_write_text
from launchers.recommend.advise import Recommendation, RecommendRequest, recommend
from launchers.recommend.probe import probe_summary

logger = log.get(__name__)


def markdown(rec: Recommendation) -> str:
    """The ranked table, the pick's command, what was left out and every assumption."""
    lines = [
        f"# kanscale recommend: {rec.shape.label} on {rec.target.name}",
        "",
        f"{rec.shape.trainable:,} trainable parameters; global batch {rec.global_batch}; "
        f"{rec.target.nodes} x {rec.target.ranks_per_node} ranks. Rates and memory are **predicted**.",
        "",
        "| # | strategy | nodes x ranks x TP | micro-batch x accum | samples/s (predicted) [interval] | bound of "
        "the step (predicted) | memory / rank (predicted) | model state / rank | headroom | fits | largest "
        "micro-batch (estimated) | widest that fits (estimated) | why |",
        "|---:|---|---|---|---:|---|---:|---:|---:|---|---:|---|---|",
    ]
    for c in rec.candidates:
        lines.append(
            f"| {c.rank}{'=' if c.tied else ''} | {c.strategy} | {rec.target.nodes} x {rec.target.ranks_per_node} x "
            f"{c.tp} | {c.micro_batch} x {c.grad_accum} | {rate(c)} | {c.bound_words} | {human_bytes(c.peak.total)} | "
            f"{human_bytes(c.peak.model_state)} | {c.headroom:.0%} | {'yes' if c.fits else 'no'} | "
            f"{limit(c.largest_micro_batch, c.micro_batch_beyond)} | {limit(c.largest_widths, c.widths_beyond)} | "
            f"{c.why} |"
        )
    lines.append("")
    tied = [c.strategy for c in rec.candidates if c.tied and c.rank == 1]
    if tied:
        lines += [
            f"= {', '.join(tied)} are equivalent within the stated uncertainty (their intervals overlap): the "
            "prediction does not rank them against each other.",
            "",
        ]
    if rec.verdict:
        lines += [f"**{rec.verdict}**", ""]
    pick = rec.pick
    if rec.command and pick is not None:  # a command is written for the pick alone
        lines += [
            f"Pick: **{pick.strategy}**, bound by {pick.bound_words} (predicted). Run it with:",
            "",
            "```bash",
            shlex.join(rec.command),
            "```",
            "",
        ]
    else:
        least = min(rec.candidates, key=lambda c: c.peak.total)
        lines += [
            f"No strategy fits in {human_bytes(rec.target.memory_per_rank)} per rank: the least is {least.strategy}, "
            f"{human_bytes(least.peak.total)} per rank at {least.micro_batch} samples per micro-batch. Give more "
            "ranks (--nnodes, --nproc-per-node), a smaller model (model.widths) or a smaller --global-batch.",
            "",
        ]
    if rec.checkpointing:
        lines += [
            "Activation checkpointing (the experiment does not checkpoint):",
            *(f"- {c}" for c in rec.checkpointing),
            "",
        ]
    if rec.excluded:
        lines += ["Not laid out: " + "; ".join(f"{k} ({v})" for k, v in rec.excluded.items()), ""]
    lines += ["Assumptions:", *(f"- {a}" for a in rec.assumptions)]
    return "\n".join(lines) + "\n"


def rate(c: Candidate) -> str:
    if not c.projection:
        return "-"
    return f"{c.samples_per_s:,.0f} [{c.samples_per_s_low:,.0f}-{c.samples_per_s_high:,.0f}]"


def limit(found: int | list[int] | None, beyond: bool) -> str:
    """A limit a search found, or ``beyond`` what it reached where it stopped at its cap."""
    if found is None:
        return "-"
    words = f"{found:,}" if isinstance(found, int) else str(found)
    return f"beyond {words}" if beyond else words


def document(rec: Recommendation) -> dict[str, Any]:
    """The recommendation as ``--json`` writes it."""

    def one(c: Candidate) -> dict[str, Any]:
        p = c.projection
        return {
            "rank": c.rank,
            "equivalent_within_uncertainty": c.tied,
            "strategy": c.strategy,
            "nodes": rec.target.nodes,
            "ranks_per_node": rec.target.ranks_per_node,
            "tp": c.tp,
            "micro_batch": c.micro_batch,
            "grad_accum": c.grad_accum,
            "fits": c.fits,
            "why": c.why,
            "samples_per_s": {"predicted": c.samples_per_s, "low": c.samples_per_s_low, "high": c.samples_per_s_high},
            "step_s": p.step_s if p else None,
            "bound": c.bound or None,
            "step_s_by_bound": c.by_bound or None,
            "exposed_comm_s": p.exposed_s if p else None,
            "model_state_bytes": c.peak.model_state,
            "model_state_host_bytes": c.peak.host,
            "gathered_bytes": c.peak.gathered,
            "beside_state_bytes": c.peak.beside,
            "peak_bytes_per_rank": c.peak.total,
            "memory_per_rank": c.capacity,
            "headroom": c.headroom,
            "largest_micro_batch": c.largest_micro_batch,
            "largest_micro_batch_beyond": c.micro_batch_beyond,
            "largest_widths_estimated": c.largest_widths,
            "largest_widths_beyond": c.widths_beyond,
        }

    return {
        "kind": "kanscale recommend",
        "predicted": True,
        "model": rec.shape.label,
        "trainable_params": rec.shape.trainable,
        "global_batch": rec.global_batch,
        "target": {
            "name": rec.target.name,
            "nodes": rec.target.nodes,
            "ranks_per_node": rec.target.ranks_per_node,
            "memory_per_rank": rec.target.memory_per_rank,
        },
        "pick": one(rec.pick) if rec.pick else None,
        "equivalent_picks": [c.strategy for c in rec.candidates if c.fits and c.rank == 1],
        "one_device": {**one(rec.one_device), "nodes": 1, "ranks_per_node": 1} if rec.one_device else None,
        "verdict": rec.verdict,
        "interval_source": rec.target.interval,
        "command": rec.command,
        "ranking": [one(c) for c in rec.candidates],
        "excluded": rec.excluded,
        "assumptions": rec.assumptions,
        "checkpointing": rec.checkpointing,
        "probe": probe_summary(rec.probe),
    }


def run_recommend(r: RecommendRequest) -> int:
    rec = recommend(r)
    text = markdown(rec)
    doc = document(rec)
    if r.validate:
        from launchers.recommend.validate import validate

        report, checked = validate(r, rec)
        text += "\n" + report
        doc["validation"] = checked
    print(text)
    if r.json:
        twin = write_json_and_markdown(r.json, doc, text, "--json")
        logger.info(f"wrote {r.json} and {twin}")
    Path(r.out).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(r.out) / "recommendation.json", json.dumps(doc, indent=2) + "\n")
    return 0
