"""The report's verdict on hand-made runs with known answers: the fastest (or a tie), the least
memory, what does not scale or did not fit, and the caveats."""

import pytest
import yaml

from analysis.records.load import load_runs
from analysis.records.run_files import RunWriter
from analysis.records.schema import RunError
from analysis.report.analyze import analyze
from analysis.report.derive import derive
from analysis.report.verdict import verdict
from tests.helpers.records import make_record, write_record


def verdict_of(tmp_path, records):
    for record in records:
        write_record(tmp_path, record)
    runs, problems = load_runs(tmp_path)
    assert problems == []
    return verdict(derive(runs), runs[runs["status"] != "ok"])


def findings(scale) -> dict[str, str]:
    return dict(scale.findings)


def test_a_clear_winner_is_named_with_its_interval(tmp_path):
    (scale,) = verdict_of(
        tmp_path,
        [
            make_record("s", strategy="single", world=1, samples_per_s=1000, window=(950, 1050)),
            make_record("d", world=2, samples_per_s=1800, window=(1700, 1900)),
            make_record("z", strategy="deepspeed", label="zero3", world=2, samples_per_s=1200, window=(1100, 1300)),
        ],
    ).scales
    assert findings(scale)["Fastest"] == (
        "ddp at 2 ranks, 1,800 samples/s [1,700-1,900], ahead of zero3 at 2 ranks (1,200 samples/s [1,100-1,300])"
    )
    assert list(scale.points["rank"]) == ["1", "2", "3"]
    assert "none: every strategy" in findings(scale)["Does not scale"]


def test_overlapping_intervals_are_a_tie_not_a_ranking(tmp_path):
    (scale,) = verdict_of(
        tmp_path,
        [
            make_record("d", world=2, samples_per_s=1800, window=(1500, 1900)),
            make_record("f", strategy="fsdp2", world=2, samples_per_s=1700, window=(1600, 1750)),
            make_record("z", strategy="deepspeed", label="zero3", world=2, samples_per_s=1000, window=(900, 1100)),
        ],
    ).scales
    assert findings(scale)["Fastest"].startswith("a tie, the intervals overlap: ddp at 2 ranks")
    assert "fsdp2 at 2 ranks 1,700" in findings(scale)["Fastest"]
    assert list(scale.points["rank"]) == ["=1", "=1", "2"]


def test_repeats_give_the_interval_over_runs(tmp_path):
    (scale,) = verdict_of(
        tmp_path,
        [make_record(f"d{i}", world=2, samples_per_s=v, window=(10, 10**6)) for i, v in enumerate([900, 1000, 1300])],
    ).scales
    row = scale.points.iloc[0]
    assert (row["low"], row["high"], row["interval"]) == (900, 1300, "repeats")
    assert "over repeated runs" in scale.spread
    assert not any("each point ran once" in c for c in scale.caveats)


def with_config(record, training: dict, out: str = "runs") -> tuple:
    return record, {"name": "hand", "training": training, "output": {"dir": out}}


def verdict_of_configured(tmp_path, configured):
    for record, config in configured:
        RunWriter(write_record(tmp_path, record)).write_config(yaml.safe_dump(config))
    runs, problems = load_runs(tmp_path)
    assert problems == []
    return verdict(derive(runs), runs[runs["status"] != "ok"])


def test_runs_of_different_experiments_are_separate_points_named_by_what_differs(tmp_path):
    (scale,) = verdict_of_configured(
        tmp_path,
        [
            with_config(
                make_record("a", strategy="single", samples_per_s=1000, window=(950, 1050)),
                {"seed": 0, "global_batch": 64},
            ),
            with_config(
                make_record("b", strategy="single", samples_per_s=3000, window=(2900, 3100)),
                {"seed": 0, "global_batch": 256},
            ),
        ],
    ).scales
    points = scale.points.set_index("strategy")
    assert set(points.index) == {"single (training.global_batch=64)", "single (training.global_batch=256)"}
    assert list(points["runs"]) == [1, 1] and set(points["interval"]) == {"windows"}  # not "repeats" of one point
    assert findings(scale)["Fastest"].startswith("single (training.global_batch=256) at 1 rank, 3,000 samples/s")


def test_runs_that_differ_only_in_seed_and_place_are_repeats(tmp_path):
    (scale,) = verdict_of_configured(
        tmp_path,
        [
            with_config(make_record("a", world=2, samples_per_s=900), {"seed": 0, "lr": 0.01}, out="here"),
            with_config(make_record("b", world=2, samples_per_s=1300), {"seed": 1, "lr": 0.01}, out="there"),
        ],
    ).scales
    (row,) = scale.points.itertuples()
    assert (row.strategy, row.runs, row.low, row.high, row.interval) == ("ddp", 2, 900, 1300, "repeats")


def test_a_speedup_is_taken_against_the_same_experiment_on_one_rank(tmp_path):
    """Two 1-rank ddp runs of different learning rates beside a 2-rank run of one of them: the
    2-rank run's baseline is its own experiment's, never the median of both."""
    (scale,) = verdict_of_configured(
        tmp_path,
        [
            with_config(make_record("slow", world=1, samples_per_s=1000), {"seed": 0, "lr": 0.01}),
            with_config(make_record("fast", world=1, samples_per_s=3000), {"seed": 0, "lr": 0.05}),
            with_config(make_record("two", world=2, samples_per_s=1800), {"seed": 0, "lr": 0.01}),
        ],
    ).scales
    two = scale.points[scale.points["world_size"] == 2].iloc[0]
    assert two["speedup"] == pytest.approx(1.8)  # against 1,000 (lr 0.01); the pooled median 2,000 gave 0.9


def test_what_is_slower_than_one_process_does_not_scale(tmp_path):
    (scale,) = verdict_of(
        tmp_path,
        [
            make_record("s", strategy="single", world=1, samples_per_s=1000, window=(950, 1050)),
            make_record("f", strategy="fsdp2", world=2, samples_per_s=700, window=(650, 760)),
            make_record("d", world=2, samples_per_s=980, window=(900, 1100)),  # within the spread: not flagged
        ],
    ).scales
    text = findings(scale)["Does not scale"]
    assert "fsdp2 at 2 ranks (700 samples/s [650-760])" in text and "ddp" not in text


def test_least_memory_and_what_did_not_fit(tmp_path):
    oom = make_record("z", strategy="deepspeed", label="zero2", world=2).model_copy(
        update={
            "status": "failed",
            "error": RunError(type="OutOfMemoryError", message="CUDA out of memory", rank=0, step=1),
        }
    )
    (scale,) = verdict_of(
        tmp_path,
        [
            make_record("d", world=2, peak_rss=10_000, state=(400, 400, 800, 0)),
            make_record("f", strategy="fsdp2", world=2, peak_rss=9_000, state=(200, 200, 400, 0)),
            oom,
        ],
    ).scales
    memory = findings(scale)["Least memory"]
    assert memory.startswith("least peak resident memory (RSS) per rank: fsdp2 at 2 ranks (8.8 KiB)")
    assert "least model state per rank: fsdp2 at 2 ranks, 800 B (the most: 1.6 KiB)" in memory
    assert findings(scale)["Did not finish"].startswith("zero2 at 2 ranks: does not fit (OutOfMemoryError")


def test_a_memory_tie_lists_the_smallest_peak_first_whatever_the_speed(tmp_path):
    (scale,) = verdict_of(
        tmp_path,
        [
            make_record("d", world=2, samples_per_s=1800, peak_rss=10_100),  # faster, and 1% more memory: a tie
            make_record("f", strategy="fsdp2", world=2, samples_per_s=1000, peak_rss=10_000),
        ],
    ).scales
    assert findings(scale)["Least memory"].startswith(
        "least peak resident memory (RSS) per rank: fsdp2 at 2 ranks (9.8 KiB), ddp at 2 ranks (9.9 KiB) (within 2%"
    )


def test_caveats_say_what_limits_the_verdict(tmp_path):
    (scale,) = verdict_of(
        tmp_path,
        [
            make_record("s", strategy="single", world=1, threads=1, cpus=2, peak_rss=10**9, comm=0.0),
            make_record("d", world=2, threads=1, cpus=2, peak_rss=10**9, comm=0.7, comm_agree=False),
        ],
    ).scales
    text = " ".join(scale.caveats)
    assert "overhead are 70.0% of a step for ddp" in text
    assert "2 ranks x 1 thread(s) per machine on its 2 core(s): the ranks took every core" in text
    assert "model state is at most 0.000% of peak memory" in text
    assert "disagree beyond noise for ddp (trust the replica)" in text
    assert "each point ran once" in text
    (calm,) = verdict_of(
        tmp_path / "calm", [make_record("d", world=2, comm=0.1, threads=1, cpus=16, peak_rss=4000)]
    ).scales
    assert not any(
        word in " ".join(calm.caveats) for word in ("overhead are", "took every core", "disagree", "at most")
    )


def test_every_scale_gets_its_own_verdict_at_the_top_of_the_report(tmp_path):
    runs = tmp_path / "runs"
    for record in [make_record("a", world=2, params=100), make_record("b", world=2, params=10**6, widths=(2, 512, 1))]:
        write_record(runs, record)
    report = analyze(runs, tmp_path / "report")
    assert [s.title.split(" (")[0] for s in report.verdict.scales] == ["bspline [2, 8, 1]", "bspline [2, 512, 1]"]
    page = (tmp_path / "report" / "report.html").read_text()
    assert page.index("<h2>Verdict</h2>") < page.index("<h2>Study:") and page.count("<b>Fastest</b>") == 2
    assert (tmp_path / "report" / "verdict.md").read_text().startswith("## Verdict")
    assert len((tmp_path / "report" / "verdict.csv").read_text().splitlines()) == 3


def test_study_tables_show_a_single_runs_spread_over_its_windows(tmp_path):
    from analysis.report.tables import study_table

    for record in [
        make_record("one", world=2, samples_per_s=1000, window=(950, 1050)),
        make_record("old", strategy="fsdp2", world=2, samples_per_s=800),
    ]:  # no windows (a v2 record)
        write_record(tmp_path, record)
    table = study_table(derive(load_runs(tmp_path)[0]), "strong")
    cells = dict(zip(table.text["strategy"], table.text["samples/s"], strict=True))
    assert cells == {"ddp": "1,000 [950-1,050]", "fsdp2": "800"}
    assert "[slowest-fastest timing window]" in table.caption


def test_a_chain_of_overlapping_intervals_shares_one_rank(tmp_path):
    """The legend says overlapping intervals share a rank: c overlaps f, which overlaps d, so all
    three share it although c's interval ends below d's; z overlaps none of them."""
    (scale,) = verdict_of(
        tmp_path,
        [
            make_record("d", world=2, samples_per_s=1800, window=(1750, 1900)),
            make_record("f", strategy="fsdp2", world=2, samples_per_s=1700, window=(1600, 1760)),
            make_record("c", strategy="fsdp1", world=2, samples_per_s=1550, window=(1500, 1620)),
            make_record("z", strategy="deepspeed", label="zero3", world=2, samples_per_s=1000, window=(900, 1100)),
        ],
    ).scales
    assert list(scale.points["rank"]) == ["=1", "=1", "=1", "2"]
    for (_, upper), (_, lower) in zip(scale.points.iterrows(), scale.points.iloc[1:].iterrows(), strict=False):
        if lower["high"] >= upper["low"]:  # overlapping neighbours never carry different marks
            assert lower["rank"] == upper["rank"]


def test_runs_of_different_global_batches_are_ranked_together_only_with_a_caveat(tmp_path):
    (scale,) = verdict_of(
        tmp_path,
        [
            make_record("b", world=2, micro_batch=256, samples_per_s=3000, window=(2900, 3100)),
            make_record("s", strategy="fsdp2", world=2, samples_per_s=1000, window=(950, 1050)),
        ],
    ).scales
    (said,) = [c for c in scale.caveats if "different global batches" in c]
    assert "128 (fsdp2)" in said and "512 (ddp)" in said
    (same,) = verdict_of(
        tmp_path / "same", [make_record("d", world=2), make_record("f", strategy="fsdp2", world=2)]
    ).scales
    assert not any("different global batches" in c for c in same.caveats)
