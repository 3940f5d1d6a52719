"""``kanscale analyze``: a directory of runs -> tables (CSV and Markdown), plots (PNG) and one
self-contained HTML report (plots embedded, no network, no server)."""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from analysis.derive import derive
from analysis.load import Problem, load_runs
from analysis.paper import paper_comparison, probe_costs
from analysis.plots import study_plots
from analysis.tables import Table, strategy_comparison, study_table

CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 2em auto; max-width: 1200px;
       color: #222; padding: 0 1em; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th { background: #f0f0f0; } td:first-child, th:first-child { text-align: left; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; }
.caption { color: #555; font-size: 0.9em; max-width: 60em; }
.problem { color: #a00; }
"""


@dataclass
class Report:
    out: Path
    tables: list[Table] = field(default_factory=list)
    plots: dict[str, list[Path]] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    unfinished: pd.DataFrame = field(default_factory=pd.DataFrame)
    html: Path | None = None


def analyze(runs_dir: str | Path, out: str | Path | None = None) -> Report:
    """Load, derive, tabulate, plot and write the report; returns what was written."""
    runs_dir = Path(runs_dir)
    out = Path(out) if out else runs_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    runs, problems = load_runs(runs_dir)
    report = Report(out=out, problems=problems)
    if runs.empty:
        report.html = write_html(report, runs_dir, runs)
        return report
    report.unfinished = runs[runs["status"] != "ok"]
    derived = derive(runs)
    if not derived.empty:
        report.tables.append(strategy_comparison(derived))
        for study in sorted(derived["study"].unique()):
            report.tables.append(study_table(derived, study))
            report.plots[study] = study_plots(derived[derived["study"] == study], study, out / "plots")
        report.tables.append(paper_comparison(derived))
        probe = probe_costs(derived)
        if probe is not None:
            report.tables.append(probe)
    for table in report.tables:
        table.data.to_csv(out / f"{table.name}.csv", index=False)
        (out / f"{table.name}.md").write_text(table.markdown())
    report.html = write_html(report, runs_dir, runs)
    return report


def embedded_png(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{html.escape(path.stem)}" src="data:image/png;base64,{data}">'


def table_html(table: Table) -> str:
    return f'<p class="caption">{html.escape(table.caption)}</p>' + table.text.to_html(index=False, escape=True)


def write_html(report: Report, runs_dir: Path, runs: pd.DataFrame) -> Path:
    parts = [f"<h1>kanscale report: {html.escape(str(runs_dir))}</h1>",
             f"<p>{len(runs)} run record(s); generated {datetime.now(timezone.utc).isoformat(timespec='seconds')}.</p>"]
    if report.problems or not report.unfinished.empty:
        parts.append("<h2>Runs not analysed</h2><ul>")
        parts += [f'<li class="problem">{html.escape(p.message)}</li>' for p in report.problems]
        for _, row in report.unfinished.iterrows():
            error = row.get("error.message") if isinstance(row.get("error.message"), str) else "no error recorded"
            parts.append(f'<li class="problem">{html.escape(row["run_id"])}: status {row["status"]}: {html.escape(error)}</li>')
        parts.append("</ul>")
    by_name = {t.name: t for t in report.tables}
    if "comparison" in by_name:
        parts += ["<h2>Strategies compared</h2>", table_html(by_name["comparison"])]
    for study, plots in report.plots.items():
        parts += [f"<h2>Study: {html.escape(study)}</h2>", table_html(by_name[study])] + [embedded_png(p) for p in plots]
    if "paper" in by_name:
        parts += ["<h2>The published study side by side</h2>", table_html(by_name["paper"])]
    if "paper_probe" in by_name:
        parts += ["<h2>What the published study's probe costs</h2>", table_html(by_name["paper_probe"])]
    page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>kanscale report</title><style>{CSS}</style>"
            f"</head><body>{''.join(parts)}</body></html>\n")
    path = report.out / "report.html"
    path.write_text(page)
    return path
