"""The tests' shared job pool (tests/helpers): one job's failure is that job's alone. A job that
raises is recorded with its error and the pool goes on; reading it fails the reading test with
that error, and the pool's other jobs keep their results."""

import pytest

from tests.helpers.launch import run_jobs
from tests.helpers.parity import STRATEGIES, experiment


def test_a_failing_job_fails_only_the_tests_that_read_it(tmp_path):
    good = experiment("bspline", STRATEGIES["ddp"], 1, str(tmp_path / "r"))
    refused = {
        **good,
        "training": {**good["training"], "lr": -1.0},
    }  # refused on every rank, as a backend's start can be
    results = run_jobs([{"id": "refused", "config": refused}, {"id": "after", "config": good}], tmp_path)
    assert results["after"]["status"] == "ok" and results["after"]["ranks_identical"]
    with pytest.raises(AssertionError, match=r"(?s)job refused raised ConfigError.*training\.lr"):
        results["refused"]
    with pytest.raises(AssertionError, match="job never has no result"):
        results["never"]


def test_a_pool_that_dies_keeps_the_results_written_before_it(tmp_path):
    good = experiment("bspline", STRATEGIES["ddp"], 1, str(tmp_path / "r"))
    crash = {**good, "fault": {"rank": "all", "step": 2, "kind": "exit"}}  # every rank exits at once, like a crash
    results = run_jobs(
        [{"id": "before", "config": good}, {"id": "crash", "config": crash}, {"id": "after", "config": good}], tmp_path
    )
    assert results["before"]["status"] == "ok"
    with pytest.raises(AssertionError, match="job after has no result: the pool stopped before it"):
        results["after"]
