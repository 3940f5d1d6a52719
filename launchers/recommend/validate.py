"""``kanscale recommend --validate K``: train the top K picks and the predicted worst on this
machine, as recommended, and set the prediction beside the measurement (rate, peak memory, model
state), with whether the predicted order held. The runs are a sweep of the suite's own under
``OUT/validate``, so ``kanscale analyze OUT/validate`` reports them too, the prediction beside
them (``recommendation.json`` there)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from analysis.records.run_files import SUMMARY_FILE, read_summary
from analysis.report.format import human_bytes
from analysis.report.prediction import PREDICTION_FILE
from kanscale import log
from kanscale.writes import atomic_write_text
from launchers.recommend.probe import keyed_dir

logger = log.get(__name__)

# No compute baseline: what is compared is the strategy's own rate and peak, and a layerwise
# baseline's step leaves its transient memory with the allocator (docs/metrics.md, peak RSS), which
# lifts a sharded strategy's measured peak above the same run's without it (docs/recommend.md).
VALIDATION_STEPS = {
    "training.steps": 30,
    "training.warmup_steps": 5,
    "training.epochs": None,
    "training.checkpoint_every": 0,
    "measurement.window_steps": 5,
    "measurement.baseline": "off",
}


def chosen(rec: Any, k: int) -> list[Any]:
    """The top ``k`` candidates that fit and the predicted worst of those that fit."""
    fitting = [c for c in rec.candidates if c.fits]
    picks = fitting[:k]
    if fitting and fitting[-1] not in picks:
        picks.append(fitting[-1])
    return picks


def validation_study(r: Any, rec: Any, picks: list[Any]) -> tuple[Path, Path]:
    """The study of the picks, written beside the directory its runs go to (keyed by the
    experiment, so another set of picks of it reuses the runs it shares); both paths."""
    from strategies.experiment import experiment_path

    config = str(experiment_path(r.config).resolve())
    settings = {**VALIDATION_STEPS, "training.global_batch": rec.global_batch, "training.micro_batch": None}
    out = keyed_dir(Path(r.out) / "validate", [config, list(r.overrides), settings, rec.target.ranks_per_node])
    study = {
        "study": "recommend-validate",
        "preset": "custom",
        "experiment": config,
        "description": "kanscale recommend --validate: the picks as recommended",
        "set": settings,
        "matrix": point(r, rec, picks[0], listed=True),
        "include": [point(r, rec, c) for c in picks[1:]],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    path = out.with_suffix(".yaml")
    atomic_write_text(path, yaml.safe_dump(study, sort_keys=False))
    return path, out


def point(r: Any, rec: Any, c: Any, listed: bool = False) -> dict[str, Any]:
    """A pick as a point of the study (the first as the matrix, each axis a list of one)."""
    axes = {
        "strategy": name_of(r, c.strategy),
        "topology": f"1x{rec.target.ranks_per_node}",
        "training.grad_accum": c.grad_accum,
    }
    return {k: [v] for k, v in axes.items()} if listed else axes


def name_of(r: Any, label: str) -> str:
    """The preset name or file that loads the strategy of ``label``."""
    names = [s.strip() for s in r.strategies.split(",") if s.strip()] if r.strategies else []
    return next((n for n in names if Path(n).stem == label), label)


def validate(r: Any, rec: Any) -> tuple[str, list[dict[str, Any]]]:
    """Train the picks, read their records, and return the comparison as Markdown and as rows."""
    from launchers.studies.sweep import run_sweep

    picks = chosen(rec, r.validate)
    if not picks:
        return "Validation: nothing fits, so nothing was trained.\n", []
    study, out = validation_study(r, rec, picks)
    logger.info(
        f"[recommend] --validate: training {', '.join(c.strategy for c in picks)} at "
        f"1 x {rec.target.ranks_per_node} ranks, {VALIDATION_STEPS['training.steps']} steps each"
    )
    run_sweep(str(study), str(out), resume=out.exists(), overrides=r.overrides, progress=False)
    measured = measurements(out)
    rows = []
    for c in picks:
        m = measured.get(c.strategy)
        rows.append(
            {
                "strategy": c.strategy,
                "predicted_rank": c.rank,
                "predicted_samples_per_s": c.samples_per_s,
                "predicted_low": c.samples_per_s_low,
                "predicted_high": c.samples_per_s_high,
                "predicted_peak_bytes": c.peak.total,
                "predicted_model_state_bytes": c.peak.model_state,
                **(m or {"status": "not run"}),
            }
        )
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(
        out / PREDICTION_FILE, json.dumps({"kind": "kanscale recommend", "validation": rows}, indent=2) + "\n"
    )
    return markdown(rows) + f"\nThe runs: {out} (kanscale analyze {out} reports them with this prediction).\n", rows


def measurements(out: Path) -> dict[str, dict[str, Any]]:
    """Per strategy label, the finished run's rate, its spread, peak and model state."""
    found: dict[str, dict[str, Any]] = {}
    for summary in sorted(out.rglob(SUMMARY_FILE)):
        record = read_summary(summary)
        t, memory = record.throughput, record.memory  # a finished record has both (RunRecord's validator)
        if record.status != "ok" or t is None or memory is None:
            found.setdefault(record.strategy.label, {"status": record.status})
            continue
        found[record.strategy.label] = {
            "status": "ok",
            "run_dir": str(summary.parent),
            "measured_samples_per_s": t.samples_per_s,
            "measured_low": t.samples_per_s_low,
            "measured_high": t.samples_per_s_high,
            "measured_peak_bytes": memory.peak_device_bytes or memory.peak_rss_bytes,
            "measured_model_state_bytes": sum(memory.model_state.model_dump().values()),
        }
    return found


def markdown(rows: list[dict[str, Any]]) -> str:
    ok = [r for r in rows if r.get("status") == "ok"]
    lines = [
        "## Validation: predicted against measured on this machine",
        "",
        "| strategy | predicted # | samples/s predicted | measured [windows] | error | peak predicted | measured "
        "| error | model state predicted | measured |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(
                f"| {r['strategy']} | {r['predicted_rank']} | {r['predicted_samples_per_s']:,.0f} | "
                f"{r.get('status')} | | | | | | |"
            )
            continue
        rate_error = r["predicted_samples_per_s"] / r["measured_samples_per_s"] - 1
        peak_error = r["predicted_peak_bytes"] / r["measured_peak_bytes"] - 1
        lines.append(
            f"| {r['strategy']} | {r['predicted_rank']} | {r['predicted_samples_per_s']:,.0f} | "
            f"{r['measured_samples_per_s']:,.0f} [{r['measured_low'] or 0:,.0f}-{r['measured_high'] or 0:,.0f}] | "
            f"{rate_error:+.0%} | {human_bytes(r['predicted_peak_bytes'])} | "
            f"{human_bytes(r['measured_peak_bytes'])} | {peak_error:+.0%} | "
            f"{human_bytes(r['predicted_model_state_bytes'])} | {human_bytes(r['measured_model_state_bytes'])} |"
        )
    predicted = [r["strategy"] for r in sorted(ok, key=lambda r: r["predicted_rank"])]
    actual = [r["strategy"] for r in sorted(ok, key=lambda r: -r["measured_samples_per_s"])]
    if len(ok) > 1:
        best = max(ok, key=lambda r: r["measured_samples_per_s"])
        pick = min(ok, key=lambda r: r["predicted_rank"])
        inside = (pick["measured_high"] or pick["measured_samples_per_s"]) >= (
            best["measured_low"] or best["measured_samples_per_s"]
        )
        lines += [
            "",
            f"Order predicted: {', '.join(predicted)}; measured: {', '.join(actual)} ("
            + ("held" if predicted == actual else "did not hold")
            + f"). The pick, {pick['strategy']}, measured "
            f"{pick['measured_samples_per_s'] / best['measured_samples_per_s']:.0%} of the fastest trained "
            f"({best['strategy']})" + (", inside its window spread" if inside and pick is not best else "") + ".",
        ]
    return "\n".join(lines) + "\n"
