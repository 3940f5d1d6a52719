"""The report says only what was measured: a mistyped directory is refused, a report directory
that cannot be written is named with --out, unreadable records are
listed and skipped, plots hold measured points only and put model state beside peak memory, the
published-study section says what to run when nothing matches it, and docs/analysis.md's example
runs as written."""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.records.load import load_runs
from analysis.report.derive import derive
from analysis.report.paper import paper_comparison
from analysis.report.plots import BASELINE_LABEL, efficiency_plot, memory_vs_size_plot, speedup_plot, state_stack_plot
from launchers.cli import build_parser, main
from launchers.studies.study import load_study
from tests.helpers.cli import refused
from tests.helpers.records import make_record, write_record

ROOT = Path(__file__).resolve().parents[1]
PAPER_MODEL = {"family": "pykan", "widths": (2, 64, 1), "grid": 10, "order": 3, "micro_batch": 512}


def kanscale(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The real ``kanscale`` in a subprocess, as a user runs it (a timeout fails, not hangs, the test)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "launchers.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def derived_from(directory: Path, records):
    for record in records:
        write_record(directory, record)
    runs, problems = load_runs(directory)
    assert problems == []
    return derive(runs)


# 1. A directory that does not exist


def test_analyze_refuses_a_directory_that_does_not_exist_and_writes_nothing(tmp_path):
    missing = tmp_path / "runs" / "strnog"
    done = kanscale("analyze", str(missing))
    assert done.returncode == 2, done.stderr
    assert f"kanscale: error: {missing}: no such directory" in done.stderr
    done = kanscale("analyze", str(missing), "--out", str(tmp_path / "report"))
    assert done.returncode == 2
    assert list(tmp_path.iterdir()) == []  # neither the default DIR/report nor --out was created
    (tmp_path / "a_file").write_text("")
    done = kanscale("analyze", str(tmp_path / "a_file"))
    assert done.returncode == 2 and "a_file: not a directory" in done.stderr


def test_analyze_of_a_directory_without_records_writes_a_report_that_says_so(tmp_path, capsys):
    (tmp_path / "runs").mkdir()
    assert main(["analyze", str(tmp_path / "runs")]) == 0
    assert f"No run records under {tmp_path / 'runs'}" in capsys.readouterr().err
    page = (tmp_path / "runs" / "report" / "report.html").read_text()
    assert f"No run records under {tmp_path / 'runs'}" in page


# 2. Unreadable records


def probed_run(directory: Path, run_id: str, steps_bytes: bytes) -> Path:
    """A finished 2-rank run that ran the published study's probe, with ``steps_bytes`` as its steps file."""
    record = make_record(run_id, world=2, **PAPER_MODEL)
    record = record.model_copy(
        update={
            "measurement": record.measurement.model_copy(update={"comm_probe": "paper", "paper_probe_overhead": 0.4})
        }
    )
    run_dir = write_record(directory, record)
    (run_dir / "steps.jsonl").write_bytes(steps_bytes)
    return run_dir


def test_every_unreadable_record_is_listed_and_the_rest_analysed(tmp_path):
    runs = tmp_path / "runs"
    write_record(runs, make_record("good1", world=1))
    write_record(runs, make_record("good2", world=2, samples_per_s=1500))
    latin1 = write_record(runs, make_record("latin1")) / "summary.json"
    latin1.write_bytes(latin1.read_bytes().replace(b'"hand"', b'"h\xe4nd"'))
    (runs / "deep").mkdir()
    (runs / "deep" / "summary.json").write_text("[" * 100_000)  # deeper than json's decoder recurses
    (runs / "a_directory" / "summary.json").mkdir(parents=True)
    (runs / "a_pipe").mkdir()
    os.mkfifo(runs / "a_pipe" / "summary.json")  # reading it would wait for a writer forever
    io_error = runs / "io_error" / "summary.json"
    io_error.parent.mkdir()
    io_error.symlink_to("/proc/self/mem")  # a regular file whose first byte cannot be read: EIO, even as root
    bad_steps = probed_run(runs, "bad_steps", b'{"step": 1, "loss": \xff}\n')
    torn_steps = probed_run(runs, "torn_steps", b"not json\n{}\n")
    no_steps = probed_run(runs, "no_steps", b"")

    done = kanscale("analyze", str(runs), "--out", str(tmp_path / "report"), timeout=120)
    assert done.returncode == 0, done.stderr
    listed = [
        line.removeprefix("not analysed: ") for line in done.stderr.splitlines() if line.startswith("not analysed: ")
    ]
    expected = {
        latin1: "not a run summary: byte 0xe4",
        runs / "deep" / "summary.json": "nested too deeply to read",
        runs / "a_directory" / "summary.json": "not a regular file",
        runs / "a_pipe" / "summary.json": "not a regular file",
        io_error: "cannot be read: Input/output error",
        bad_steps / "steps.jsonl": "not UTF-8 text: byte 0xff at line 1",
        torn_steps / "steps.jsonl": ":1: not a valid step record",
        no_steps / "steps.jsonl": "no timed probed and unprobed steps",
    }
    for path, reason in expected.items():
        assert any(line.startswith(f"{path}:") and reason in line for line in listed), (path, reason, done.stderr)
    page = (tmp_path / "report" / "report.html").read_text()
    assert "<h2>Verdict</h2>" in page and "5 run record(s)" in page  # good1, good2 and the three probed runs
    for path in expected:
        assert str(path) in page


# 3. Plots: measured points only, the one-process baseline apart


def strategy_lines(fig) -> dict[str, tuple[list, list]]:
    ax = fig.axes[0]
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def test_scaling_plots_draw_only_measured_points_and_the_single_process_baseline_apart(tmp_path):
    derived = derived_from(
        tmp_path,
        [
            make_record("single", strategy="single", world=1, micro_batch=128, samples_per_s=1000),
            make_record(
                "fsdp2", strategy="fsdp2", world=2, micro_batch=64, samples_per_s=1500
            ),  # global 128: vs single
            make_record("ddp1", world=1, micro_batch=64, samples_per_s=900),
            make_record("ddp2", world=2, micro_batch=64, samples_per_s=1200),
        ],
    )
    measured = derived.groupby("strategy_label")["world_size"].apply(set).to_dict()
    for plot, one in ((speedup_plot, 1.0), (efficiency_plot, 100.0)):
        lines = strategy_lines(plot(derived))
        for strategy, sizes in measured.items():
            assert set(lines[strategy][0]) == sizes, (plot.__name__, strategy, lines[strategy])
        assert lines["fsdp2"][0] == [2]  # no invented point at 1 rank
        star = next(line for line in plot(derived).axes[0].get_lines() if line.get_label() == BASELINE_LABEL)
        assert (list(star.get_xdata()), list(star.get_ydata())) == ([1], [one])
        assert star.get_marker() == "*" and star.get_markerfacecolor() == "none" and star.get_linestyle() == "None"
        legend = [t.get_text() for t in plot(derived).axes[0].get_legend().get_texts()]
        assert BASELINE_LABEL == "1-process baseline (another run: single)" and BASELINE_LABEL in legend


def test_no_baseline_marker_where_every_strategy_has_its_own_one_rank_run(tmp_path):
    derived = derived_from(tmp_path, [make_record("d1", world=1), make_record("d2", world=2, samples_per_s=1800)])
    lines = strategy_lines(speedup_plot(derived))
    assert BASELINE_LABEL not in lines and lines["ddp"] == ([1, 2], [1.0, 1.8])


# 4. Model state beside the peak memory it is part of


def test_memory_plots_put_model_state_in_the_context_of_peak_memory(tmp_path):
    mib = 2**20
    derived = derived_from(
        tmp_path,
        [
            make_record(
                f"{s}-{p}",
                study="memory",
                strategy=s,
                world=2,
                params=p,
                widths=(2, p // 10, 1),
                peak_rss=350 * mib,
                state=(1024, 1024, 2048, 0) if s == "fsdp2" else (2048, 2048, 4096, 0),
            )
            for s in ("ddp", "fsdp2")
            for p in (1000, 100000)
        ],
    )
    fig = state_stack_plot(derived)
    texts = [" ".join(t.get_text().split()) for ax in fig.axes for t in ax.texts]
    # fsdp2's 4 KiB of model state is 4096 / (350 * 2**20) of its peak
    assert "model state = 0.0011% of peak RSS" in texts and "model state = 0.0022% of peak RSS" in texts
    peak_ax = fig.axes[1]
    heights = sorted({round(patch.get_height(), 6) for patch in peak_ax.patches})
    assert heights[-1] == 350.0 and peak_ax.get_ylabel() == "MiB per rank"
    fig = memory_vs_size_plot(derived)
    state_ax, peak_ax = fig.axes
    assert state_ax.get_ylim() == peak_ax.get_ylim()  # one scale: the gap between the panels is the real one
    (box,) = peak_ax.texts
    assert "ddp: 0.0022%" in box.get_text() and "fsdp2: 0.0011%" in box.get_text()


# 5. The published study side by side: what to run when nothing matches


def commands(caption: str) -> list[str]:
    return re.findall(r"`(kanscale sweep [^`]+)`", caption)


def test_the_published_study_section_says_what_to_run_when_no_run_matches(tmp_path):
    runs = tmp_path / "runs"
    write_record(runs, make_record("d1", world=1))
    write_record(runs, make_record("d2", world=2))  # a B-spline KAN: not the study's configuration
    caption = paper_comparison(derive(load_runs(runs)[0])).caption
    assert caption.startswith("None of these runs matches the published configuration")
    found = commands(caption)
    assert "kanscale sweep configs/studies/strong_cpu.yaml --out runs/strong" in found
    assert "kanscale sweep configs/studies/weak_paper.yaml --out runs/weak --submit" in found
    assert {c.split()[2] for c in found} == {
        f"configs/studies/{s}_{kind}.yaml"
        for s in ("strong", "weak", "comm", "model_size")
        for kind in ("cpu", "paper")
    }
    for command in found:  # each is a real sweep of a shipped study that runs the published configuration
        args = build_parser().parse_args(shlex.split(command)[1:])
        study = load_study(ROOT / args.study)
        assert args.command == "sweep" and study.study == Path(args.study).stem.rsplit("_", 1)[0]
        assert Path(study.experiment).name == "paper_kan64.yaml"
        assert not {"model.family", "model.grid", "model.k", "training.micro_batch", "task.name"} & set(study.set)
    assert main(["analyze", str(runs), "--out", str(tmp_path / "report")]) == 0
    page = (tmp_path / "report" / "report.html").read_text()
    section = page[page.index("The published study side by side") :]
    assert "None of these runs matches the published configuration" in section
    assert "<code>kanscale sweep configs/studies/strong_cpu.yaml --out runs/strong</code>" in section


def test_the_published_study_section_names_only_the_studies_without_a_matching_run(tmp_path):
    derived = derived_from(
        tmp_path, [make_record("p1", world=1, **PAPER_MODEL), make_record("p2", world=2, **PAPER_MODEL)]
    )
    caption = paper_comparison(derived).caption
    assert "None of these runs" not in caption and "beside 2 kanscale point(s)" in caption
    assert caption.startswith("No run here matches the published weak, comm, model_size studies")
    assert not any("strong_" in c for c in commands(caption)) and any("weak_cpu" in c for c in commands(caption))


# 7. docs/analysis.md's example


def test_the_python_api_example_in_docs_analysis_runs_as_written(tmp_path, monkeypatch, capsys):
    doc = (ROOT / "docs" / "analysis.md").read_text()
    example = doc[doc.index("## From Python") :]
    code = re.search(r"```python\n(.*?)```", example, re.S).group(1)
    runs = tmp_path / "runs" / "demo"
    write_record(runs, make_record("single", strategy="single", world=1, micro_batch=128, samples_per_s=1000))
    write_record(runs, make_record("ddp", world=2, micro_batch=64, samples_per_s=1500))
    (runs / "broken").mkdir()
    (runs / "broken" / "summary.json").write_text("{")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/analysis.md", "exec"), {})
    out = capsys.readouterr().out
    assert "skipped: runs/demo/broken/summary.json: not valid JSON" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.split()[:1] in (["single"], ["ddp"])}
    assert rows["single"] == ["1", "1.0", "1.00", "own", "1-rank"]
    assert rows["ddp"] == ["2", "1.5", "0.75", "single", "process"]  # 1500 / 1000 samples/s, over 2 ranks
    assert f"report: {Path('runs/demo/report/report.html')}" in out
    assert (tmp_path / "runs" / "demo" / "report" / "report.html").is_file()


@pytest.fixture
def read_only_runs(tmp_path) -> Path:
    """A directory of one run record that this user cannot write: chmod'ed, or for root (whom
    modes do not stop) a read-only bind mount of it."""
    runs = tmp_path / "runs"
    write_record(runs, make_record("r1"))
    if os.geteuid() != 0:
        for path in (runs / "r1", runs):
            path.chmod(0o555)
        yield runs
        for path in (runs, runs / "r1"):
            path.chmod(0o755)
        return
    if shutil.which("mount") is None:
        pytest.skip("a read-only directory for root is a read-only bind mount, and there is no mount command")
    done = subprocess.run(["mount", "--bind", str(runs), str(runs)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"mount --bind is not permitted here: {done.stderr.strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(runs)], check=True, capture_output=True)
        yield runs
    finally:
        subprocess.run(["umount", str(runs)], capture_output=True)


def test_analyze_of_a_read_only_directory_names_the_report_directory_and_out(read_only_runs, tmp_path, capsys):
    err = refused(["analyze", str(read_only_runs)], capsys)
    assert f"--out (not given: DIR/report): {read_only_runs / 'report'} cannot be written: {read_only_runs}" in err
    assert "read-only" in err and "--out REPORT_DIR" in err
    assert main(["analyze", str(read_only_runs), "--out", str(tmp_path / "report")]) == 0
    assert (tmp_path / "report/report.html").is_file()
