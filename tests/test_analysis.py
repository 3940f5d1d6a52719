"""Derived metrics with known answers, the report from a real sweep, and runs that cannot be read."""

import json
from pathlib import Path

import pytest

from analysis.records.load import load_runs
from analysis.records.schema import RunError
from analysis.report.analyze import analyze
from analysis.report.derive import derive, summarize, with_spread
from analysis.report.tables import study_table
from analysis.report.verdict import verdict
from launchers.cli import main
from tests.helpers.records import make_record, write_record

ROOT = Path(__file__).resolve().parents[1]


def derived_from(tmp_path, records):
    for record in records:
        write_record(tmp_path, record)
    runs, problems = load_runs(tmp_path)
    assert problems == []
    return derive(runs).set_index("run_id")


def test_speedup_efficiency_and_retention_against_the_same_strategys_one_rank_run(tmp_path):
    d = derived_from(
        tmp_path,
        [
            make_record("ddp1", world=1, samples_per_s=1000),
            make_record("ddp2", world=2, samples_per_s=1800),
            make_record("ddp4", world=4, nodes=2, samples_per_s=3000),
            make_record("z1", strategy="deepspeed", label="zero3", world=1, samples_per_s=500),
            make_record("z2", strategy="deepspeed", label="zero3", world=2, samples_per_s=900),
            make_record("fsdp2", strategy="fsdp2", world=2, samples_per_s=700),  # no 1-rank run
        ],
    )
    assert d.loc["ddp2", "speedup"] == pytest.approx(1.8) and d.loc["ddp2", "efficiency"] == pytest.approx(0.9)
    assert d.loc["ddp4", "speedup"] == pytest.approx(3.0) and d.loc["ddp4", "efficiency"] == pytest.approx(0.75)
    assert d.loc["ddp4", "retention"] == pytest.approx(0.75)  # per-rank 750 / 1000
    assert d.loc["z2", "strategy_label"] == "zero3" and d.loc["z2", "speedup"] == pytest.approx(1.8)
    assert d.loc["fsdp2", "speedup"] != d.loc["fsdp2", "speedup"]  # NaN: no baseline of its own


def test_a_strategy_without_a_one_rank_run_is_measured_against_the_single_process_run_of_its_global_batch(tmp_path):
    d = derived_from(
        tmp_path,
        [
            make_record("single", strategy="single", world=1, micro_batch=128, samples_per_s=1000),
            make_record("other-batch", strategy="single", world=1, micro_batch=64, samples_per_s=5000),
            make_record("fsdp2", strategy="fsdp2", world=2, micro_batch=64, samples_per_s=1500),  # global 128
            make_record("ddp1", world=1, micro_batch=64, samples_per_s=900),
            make_record("ddp2", world=2, micro_batch=64, samples_per_s=1200),
        ],
    )
    assert d.loc["fsdp2", "baseline"] == "single process" and d.loc["fsdp2", "speedup"] == pytest.approx(1.5)
    assert d.loc["fsdp2", "efficiency"] == pytest.approx(0.75)
    # a strategy's own 1-rank run (same per-rank batch) wins over the single-process run
    assert d.loc["ddp2", "baseline"] == "own 1-rank" and d.loc["ddp2", "speedup"] == pytest.approx(1200 / 900)
    table = study_table(d.reset_index(), "strong")
    assert "one-process `single` run with the same global batch" in table.caption


def test_comm_overhead_and_memory_per_byte(tmp_path):
    d = derived_from(tmp_path, [make_record("a", comm=0.25, params=5000, peak_rss=20_000, state=(10, 20, 30, 40))])
    assert d.loc["a", "comm_overhead_pct"] == pytest.approx(25.0)
    assert d.loc["a", "params_per_byte"] == pytest.approx(0.25)
    assert d.loc["a", "model_state_bytes"] == 100 and d.loc["a", "peak_memory_kind"] == "RSS"


def test_repeats_show_median_and_spread(tmp_path):
    d = derived_from(
        tmp_path, [make_record(f"r{i}", world=2, samples_per_s=v) for i, v in enumerate([900, 1000, 1300])]
    )
    summary = summarize(d.reset_index(), ["strategy_label"], ["samples_per_s"])
    assert list(with_spread(summary, "samples_per_s", lambda v: f"{v:.0f}")) == ["1000 [900-1300]"]
    table = study_table(d.reset_index(), "strong")
    assert table.text.loc[0, "samples/s"] == "1,000 [900-1,300]" and table.text.loc[0, "runs"] == 3


def test_the_verdict_compares_each_model_on_its_own_and_states_the_hardware(tmp_path):
    d = derived_from(
        tmp_path,
        [
            make_record("d1", world=1, samples_per_s=1000),
            make_record("d2", world=2, samples_per_s=1600),
            make_record("f1", strategy="fsdp2", world=1, samples_per_s=800),
            make_record("f2", strategy="fsdp2", world=2, samples_per_s=1500, state=(200, 200, 400, 0)),
            make_record("big", strategy="fsdp2", world=2, widths=(2, 512, 1), params=10**6),
        ],
    ).reset_index()
    small, big = verdict(d).scales
    rows = small.points.set_index(["strategy", "world_size"])
    assert rows.loc[("ddp", 2), "speedup"] == pytest.approx(1.6) and rows.loc[("fsdp2", 2), "speedup"] == pytest.approx(
        1.875
    )
    assert rows.loc[("fsdp2", 2), "model_state_bytes"] == 800 and len(big.points) == 1
    assert "test CPU (cpu)" in small.title and big.title.startswith("bspline [2, 512, 1] (1,000,000 parameters)")


def test_unreadable_runs_are_listed_and_the_rest_analysed(tmp_path, capsys):
    runs = tmp_path / "runs"
    write_record(runs, make_record("good", world=1))
    write_record(runs, make_record("good2", world=2, samples_per_s=1500))
    (runs / "corrupt").mkdir()
    (runs / "corrupt" / "summary.json").write_text('{"schema_version": 1, "run_id": ')
    future = json.loads((runs / "good" / "summary.json").read_text())
    (runs / "future").mkdir()
    (runs / "future" / "summary.json").write_text(json.dumps({**future, "schema_version": 8}))
    (runs / "no_summary").mkdir()
    (runs / "no_summary" / "steps.jsonl").write_text("")
    failed = make_record("failed", world=2).model_copy(
        update={"status": "failed", "error": RunError(type="RuntimeError", message="rank 1 died", rank=1, step=3)}
    )
    write_record(runs, failed)
    assert main(["analyze", str(runs), "--out", str(tmp_path / "report")]) == 0
    captured = capsys.readouterr()
    assert "corrupt/summary.json: not valid JSON" in captured.err
    assert "schema_version 8 is not one this kanscale reads" in captured.err
    assert "no_summary: has steps.jsonl or config.yaml but no summary.json" in captured.err
    assert "failed has status failed" in captured.err
    page = (tmp_path / "report" / "report.html").read_text()
    assert "rank 1 died" in page and "<h2>Verdict</h2>" in page


@pytest.fixture(scope="module")
def real_sweep(tmp_path_factory):
    """A real small strong-scaling sweep: two strategies at 1 and 2 ranks."""
    tmp = tmp_path_factory.mktemp("analysis")
    study = tmp / "strong.yaml"
    study.write_text(f"""
study: strong
preset: cpu
experiment: {ROOT / "configs/experiments/quickstart.yaml"}
set: {{training.steps: 10, training.micro_batch: 64, measurement.baseline_steps: 2}}
matrix: {{strategy: [ddp, zero3], topology: [1x1, 1x2]}}
""")
    assert main(["sweep", str(study), "--out", str(tmp / "runs")]) == 0
    return tmp / "runs", analyze(tmp / "runs", tmp / "report")


@pytest.mark.slow  # the slow tier (make test-slow)
def test_report_from_a_real_sweep_has_every_table_and_plot(real_sweep):
    _runs_dir, report = real_sweep
    names = {t.name for t in report.tables}
    assert names == {"strong", "paper"} and len(report.verdict.scales) == 1
    for name in names:
        assert (report.out / f"{name}.csv").stat().st_size > 0 and (report.out / f"{name}.md").read_text().count(
            "|"
        ) > 10
    plots = report.plots["strong"]
    assert [p.stem for p in plots] == ["strong_speedup", "strong_efficiency", "strong_comm_overhead"]
    for plot in plots:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
    page = report.html.read_text()
    assert page.count("data:image/png;base64,") == len(plots)
    assert "http://" not in page and "https://" not in page and "<script" not in page  # opens from disk, offline
    csp = (
        "<meta http-equiv='Content-Security-Policy' "
        "content=\"default-src 'none'; img-src data:; style-src 'unsafe-inline'\">"
    )
    assert page.index(csp) < page.index("<title>")  # declared before anything the page holds
    strong = next(t for t in report.tables if t.name == "strong").data
    one_rank = strong[strong["topology.world_size"] == 1]
    assert list(one_rank["speedup_median"]) == [1.0, 1.0]


def test_memory_plots_from_records(tmp_path):
    d = derived_from(
        tmp_path / "runs",
        [
            make_record(
                f"{s}-{p}",
                study="memory",
                strategy=s,
                world=2,
                params=p,
                widths=(2, p // 10, 1),
                state=(p, p, 2 * p, 0) if s == "ddp" else (p // 2, p // 2, p, 0),
            )
            for s in ("ddp", "fsdp2")
            for p in (1000, 100000)
        ],
    )
    from analysis.report.plots import study_plots

    plots = study_plots(d.reset_index(), "memory", tmp_path / "plots")
    assert [p.stem for p in plots] == ["memory_memory_vs_size", "memory_model_state"]
    assert all(p.stat().st_size > 10_000 for p in plots)


def test_the_published_study_beside_runs_of_its_configuration(tmp_path, capsys):
    paper_model = {"family": "pykan", "widths": (2, 64, 1), "grid": 10, "order": 3, "micro_batch": 512}
    write_record(tmp_path, make_record("p1", world=1, samples_per_s=8000, **paper_model))
    write_record(tmp_path, make_record("p2", world=2, samples_per_s=12000, **paper_model))
    write_record(tmp_path, make_record("other", world=2, samples_per_s=99999))  # not the study's model
    assert main(["compare-paper", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = [
        [cell.strip() for cell in line.split("|")[1:-1]] for line in out.splitlines() if line.startswith("| strong")
    ]
    assert rows[-1][:4] == ["strong", "4x2", "64", "published (DDP)"] and rows[-1][7] == "5.97"  # 8 GPUs, 4 nodes
    ours = [line for line in out.splitlines() if "kanscale ddp" in line]
    assert len(ours) == 2 and "12,000" in ours[1] and "1.5" in ours[1] and "75.0%" in ours[1]
    assert "99,999" not in out
    assert "the study's probe timed an extra all-reduce" in out


def test_the_study_probes_cost_is_measured_within_each_run(tmp_path):
    from analysis.records.run_files import RunWriter
    from analysis.records.schema import MeasurementInfo, StepRecord
    from analysis.report.paper import probe_costs, published_drop

    record = make_record("probed", world=2, family="pykan", widths=(2, 64, 1), grid=10, micro_batch=512)
    record = record.model_copy(
        update={
            "measurement": MeasurementInfo(
                comm_method="test", comm_probe="paper", baseline_steps=1, paper_probe_overhead=0.4
            )
        }
    )
    run_dir = write_record(tmp_path, record)
    # probed steps (2, 4, ...) take 150 ms, the others 100 ms: the probe adds 25% per step on average
    RunWriter(run_dir).append_steps(
        [
            StepRecord(
                step=n,
                loss=1.0,
                time_s_max=0.15 if n % 2 == 0 else 0.10,
                time_s_mean=0.1,
                comm_s_max=0,
                comm_s_mean=0,
                samples=1024,
                timed=n > 2,
            )
            for n in range(1, 21)
        ]
    )
    d = derive(load_runs(tmp_path)[0])
    assert d.loc[0, "strategy_label"] == "ddp+paper_probe"
    table = probe_costs(d)
    row = table.data.iloc[0]
    assert row["probe_share"] == pytest.approx(0.25) and row["throughput_loss"] == pytest.approx(0.2)
    assert published_drop() == pytest.approx(1 - 3549.4 / 4442.1)
