"""``tracking.report_to``: each step's loss, learning rate and rate, the run's settings and its
results, written by TensorBoard's and MLflow's own libraries and read back with them; a tracker
that is not installed is refused before anything runs, with the line that installs it."""

import sys

import pytest

from analysis.records.run_files import read_steps, read_summary
from kanscale.errors import ConfigError
from strategies.experiment import parse_experiment
from tests.helpers.launch import run_here
from tests.helpers.runs import small

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    out = tmp_path_factory.mktemp("tracked")
    config = {**small(out, checkpoint_every=0), "tracking": {"report_to": ["tensorboard", "mlflow"]}}
    trainer = run_here(config)
    return trainer.run_dir, read_steps(trainer.run_dir), read_summary(trainer.run_dir)


def test_tensorboard_events_hold_every_step_and_the_results(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, steps, record = tracked
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [s.step for s in steps]
    assert [e.value for e in loss] == pytest.approx([s.loss for s in steps], rel=1e-6)  # stored as float32
    assert [e.value for e in events.Scalars("train/lr")] == pytest.approx([s.lr for s in steps], rel=1e-6)
    (rate,) = events.Scalars("results/samples_per_s")
    assert rate.value == pytest.approx(record.throughput.samples_per_s, rel=1e-6)
    assert events.Scalars("memory/rank0_rss_bytes")[-1].value > 0
    assert "training.lr" in str(events.Tensors("run/settings/text_summary")[0].tensor_proto)


def test_mlflow_runs_hold_every_step_the_settings_and_the_results(tracked, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # what the run set for its own file store
    run_dir, steps, record = tracked
    client = MlflowClient(tracking_uri=(run_dir.parent / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("safety").experiment_id])
    assert run.info.run_name == run_dir.name and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "train.loss")
    assert [(m.step, m.value) for m in history] == [(s.step, pytest.approx(s.loss)) for s in steps]
    assert run.data.params["training.lr"] == "0.02" and run.data.params["model.family"] == "bspline"
    assert run.data.metrics["results.final_loss"] == pytest.approx(record.final_loss)


def test_a_tracker_that_is_not_installed_is_refused_with_its_install_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed: find_spec raises
    monkeypatch.setattr("kanscale.extras.installed", lambda module: module != "tensorboard")
    with pytest.raises(
        ConfigError, match=r"tracking.report_to: tensorboard needs tensorboard.*kanscale\[tensorboard\]"
    ):
        parse_experiment({**small(tmp_path), "tracking": {"report_to": ["tensorboard"]}})


def test_tracking_is_no_part_of_what_a_run_is(tmp_path):
    plain = parse_experiment(small(tmp_path))
    tracked = parse_experiment({**small(tmp_path), "tracking": {"report_to": ["tensorboard"]}})
    assert plain.digest() == tracked.digest()  # a run resumes, and repeats pool, with or without trackers


def test_a_tracker_that_fails_is_named_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    from strategies.loop.trackers import TensorBoardTracker

    def gone(self, steps, memory):
        raise ConnectionError("the tracking server went away")

    monkeypatch.setattr(TensorBoardTracker, "log_steps", gone)
    trainer = run_here({**small(tmp_path, checkpoint_every=0), "tracking": {"report_to": ["tensorboard"]}})
    assert read_summary(trainer.run_dir).status == "ok" and len(read_steps(trainer.run_dir)) == 12
    said = [r.getMessage() for r in caplog.records if "tracking:" in r.getMessage()]
    assert len(said) == 1 and "TensorBoardTracker could not log its steps" in said[0]
