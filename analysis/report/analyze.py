"""``kanscale analyze``: a directory of runs -> tables (CSV and Markdown), plots (PNG) and one
self-contained HTML report (plots embedded, no network, no server; a Content-Security-Policy lets
the page load nothing but its own inline styles and data: images)."""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from analysis.records.load import Problem, load_runs
from analysis.records.run_files import SUMMARY_FILE
from analysis.report.budget import budget_table
from analysis.report.derive import derive
from analysis.report.paper import paper_comparison, probe_costs
from analysis.report.plots import study_plots
from analysis.report.prediction import prediction_table
from analysis.report.tables import Table, study_table
from analysis.report.verdict import Verdict, verdict
from kanscale.writes import atomic_write_text

CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 2em auto; max-width: 1200px;
       color: #222; padding: 0 1em; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th { background: #f0f0f0; } td:first-child, th:first-child { text-align: left; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; }
.caption { color: #555; font-size: 0.9em; max-width: 60em; }
.problem { color: #a00; }
.verdict li { margin: 0.2em 0; max-width: 70em; } .caveat { color: #6a4a00; }
"""
# The page fetches nothing: no scripts, no fonts, no frames; images only as data: URLs.
CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"


# One rank's peak rate for model FLOPs utilisation: given the runs' threads per rank, the FLOP/s
# and where they came from, in words (a datasheet figure, a cluster file, a GEMM measured here).
PeakRate = Callable[[int], tuple[float, str]]
DEFAULT_MEMORY_BUDGET = 80 * 2**30  # one 80 GB GPU's memory, per rank


@dataclass
class Report:
    out: Path
    tables: list[Table] = field(default_factory=list)
    plots: dict[str, list[Path]] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    unfinished: pd.DataFrame = field(default_factory=pd.DataFrame)
    records: int = 0  # run records read, finished or not
    finished: int = 0
    verdict: Verdict | None = None
    html: Path | None = None


def analyze(
    runs_dir: str | Path,
    out: str | Path | None = None,
    peak: PeakRate | None = None,
    memory_budget: float = DEFAULT_MEMORY_BUDGET,
) -> Report:
    """Load, derive, tabulate, plot and write the report; returns what was written. A ``runs_dir``
    that does not exist is refused (ConfigError) before anything is written. ``peak``: one rank's
    peak rate, for MFU (None: the tables give achieved FLOP/s alone); ``memory_budget``: bytes
    per rank the memory budget table solves for."""
    runs_dir = Path(runs_dir)
    runs, problems = load_runs(runs_dir)
    out = Path(out) if out else runs_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out=out, problems=problems, records=len(runs))
    if runs.empty:
        report.html = write_html(report, runs_dir)
        return report
    report.unfinished = runs[runs["status"] != "ok"]
    rate, source = peak(threads_per_rank(runs)) if peak is not None else (None, None)
    derived = derive(runs, rate)
    report.finished = len(derived)
    if not derived.empty:
        report.verdict = verdict(derived, report.unfinished)
        atomic_write_text(out / "verdict.csv", report.verdict.data.to_csv(index=False))
        atomic_write_text(out / "verdict.md", report.verdict.markdown())
        for study in sorted(derived["study"].unique()):
            report.tables.append(study_table(derived, study, source))
            report.plots[study] = study_plots(derived[derived["study"] == study], study, out / "plots")
        budget = budget_table(derived, memory_budget)
        if budget is not None:
            report.tables.append(budget)
        report.tables.append(paper_comparison(derived))
        probe = probe_costs(derived, report.problems)
        if probe is not None:
            report.tables.append(probe)
        predicted = prediction_table(runs_dir)
        if predicted is not None:
            report.tables.append(predicted)
    for table in report.tables:
        atomic_write_text(out / f"{table.name}.csv", table.data.to_csv(index=False))
        atomic_write_text(out / f"{table.name}.md", table.markdown())
    report.html = write_html(report, runs_dir)
    return report


def threads_per_rank(runs: pd.DataFrame) -> int:
    """The torch threads the runs' ranks had, the most common (1 where no record says)."""
    threads = runs.get("topology.threads_per_rank", pd.Series(dtype=float)).dropna()
    return int(threads.mode().iloc[0]) if not threads.empty else 1


def embedded_png(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{html.escape(path.stem)}" src="data:image/png;base64,{data}">'


def text_html(text: str) -> str:
    """Escaped text with its `backticked` spans (names, commands) set as code."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


def table_html(table: Table) -> str:
    return f'<p class="caption">{text_html(table.caption)}</p>' + table.text.to_html(index=False, escape=True)


def verdict_html(result: Verdict) -> list[str]:
    """The verdict, first thing on the page: per scale its findings, caveats and table."""
    parts = ["<h2>Verdict</h2>"]
    for scale in result.scales:
        parts.append(f"<h3>{text_html(scale.title)}</h3><ul class='verdict'>")
        parts += [f"<li><b>{html.escape(what)}</b>: {text_html(text)}</li>" for what, text in scale.findings]
        parts += [f"<li class='caveat'><i>Caveat</i>: {text_html(c)}</li>" for c in scale.caveats]
        parts.append(
            "</ul>"
            + scale.table.to_html(index=False, escape=True)
            + f'<p class="caption">{text_html(scale.spread)}</p>'
        )
    return parts


def summary_line(report: Report, runs_dir: Path) -> str:
    """How many records were found, finished and analysed, in words; an empty result says so."""
    if report.records == 0:
        return (
            f"No run records under {runs_dir} (no readable {SUMMARY_FILE} in it or below it), so there is nothing "
            "to analyse" + (": see the files listed below." if report.problems else ".")
        )
    if report.finished == 0:
        return (
            f"{report.records} run record(s) under {runs_dir}, none finished (status ok), so there is nothing "
            "to compare."
        )
    return f"{report.records} run record(s) under {runs_dir}, {report.finished} finished and analysed."


def write_html(report: Report, runs_dir: Path) -> Path:
    parts = [
        f"<h1>kanscale report: {html.escape(str(runs_dir))}</h1>",
        f"<p>{html.escape(summary_line(report, runs_dir))} "
        f"Generated {datetime.now(timezone.utc).isoformat(timespec='seconds')}.</p>",
    ]
    if report.problems or not report.unfinished.empty:
        parts.append("<h2>Not analysed</h2><ul>")
        parts += [f'<li class="problem">{html.escape(p.message)}</li>' for p in report.problems]
        for _, row in report.unfinished.iterrows():
            message = row.get("error.message")
            error = message if isinstance(message, str) else "no error recorded"
            parts.append(
                f'<li class="problem">{html.escape(row["run_id"])}: status {row["status"]}: {html.escape(error)}</li>'
            )
        parts.append("</ul>")
    if report.verdict is not None:
        parts += verdict_html(report.verdict)
    by_name = {t.name: t for t in report.tables}
    for study, plots in report.plots.items():
        parts += [f"<h2>Study: {html.escape(study)}</h2>", table_html(by_name[study])] + [
            embedded_png(p) for p in plots
        ]
    if "memory_budget" in by_name:
        parts += ["<h2>Memory budget: the largest micro-batch per rank</h2>", table_html(by_name["memory_budget"])]
    if "paper" in by_name:
        parts += ["<h2>The published study side by side</h2>", table_html(by_name["paper"])]
    if "recommend" in by_name:
        parts += ["<h2>Predicted by kanscale recommend, and measured</h2>", table_html(by_name["recommend"])]
    if "paper_probe" in by_name:
        parts += ["<h2>What the published study's probe costs</h2>", table_html(by_name["paper_probe"])]
    page = (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<meta http-equiv='Content-Security-Policy' content=\"{CSP}\"><title>kanscale report</title>"
        f"<style>{CSS}</style></head><body>{''.join(parts)}</body></html>\n"
    )
    path = report.out / "report.html"
    atomic_write_text(path, page)  # UTF-8, what the meta tag declares, whatever the locale
    return path
