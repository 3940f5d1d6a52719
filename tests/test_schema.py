"""Metrics schema v3: round trip, rejection of malformed records, the shipped JSON Schemas, v1 and v2
records migrated on read."""

import json
from pathlib import Path

import jsonschema
import pytest

from analysis.records.run_files import RecordError, RunWriter, read_steps, read_summary
from analysis.records.schema import RunRecord, StepRecord, json_schema
from strategies.experiment import load_experiment
from strategies.loop.trainer import train

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    cfg = load_experiment(
        ROOT / "configs/experiments/quickstart.yaml", [f"output.dir={out}", "training.steps=30", "task.n_train=2000"]
    )
    result = train(cfg, show_progress=False)
    return result.record, result.run_dir


def test_a_real_run_round_trips(finished_run):
    record, run_dir = finished_run
    assert record.status == "ok"
    assert read_summary(run_dir) == record
    steps = read_steps(run_dir)
    assert [s.step for s in steps] == list(range(1, 31))
    assert sum(s.timed for s in steps) == 25 == record.batch.timed_steps
    assert record.final_loss == steps[-1].loss
    assert (run_dir / "config.yaml").exists()


def test_the_shipped_json_schema_is_current_and_validates_real_records(finished_run):
    shipped = json.loads((ROOT / "analysis/records/run_record.schema.json").read_text())
    assert shipped == json_schema(), "regenerate with: kanscale schema --out analysis/records/run_record.schema.json"
    _, run_dir = finished_run
    summary = json.loads((run_dir / "summary.json").read_text())
    jsonschema.validate(summary, shipped)  # the root is the run record
    for line in (run_dir / "steps.jsonl").read_text().splitlines():
        jsonschema.validate(json.loads(line), {**shipped, "$ref": "#/$defs/StepRecord"})
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**summary, "status": "done"}, shipped)


@pytest.mark.parametrize("field", ["throughput", "comm", "timings", "final_loss"])
def test_the_json_schema_refuses_a_finished_record_without_its_results(finished_run, field):
    """A finished run's results are required by the JSON Schema itself, as by the classes."""
    shipped = json.loads((ROOT / "analysis/records/run_record.schema.json").read_text())
    summary = json.loads((finished_run[1] / "summary.json").read_text())
    assert field in shipped["$defs"]["RunRecord"]["allOf"][0]["then"]["required"]
    missing = {k: v for k, v in summary.items() if k != field}
    with pytest.raises(jsonschema.ValidationError, match=field):
        jsonschema.validate(missing, shipped)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**summary, field: None}, shipped)
    jsonschema.validate({**missing, "status": "incomplete"}, shipped)  # a run still going has no results yet
    assert {"run_id", "status", "strategy", "topology"} <= set(shipped["$defs"]["RunRecord"]["required"])


def test_malformed_records_are_rejected(finished_run, tmp_path):
    record, _ = finished_run
    with pytest.raises(ValueError, match="status ok must have timings"):
        RunRecord.model_validate({**record.model_dump(), "timings": None})
    with pytest.raises(ValueError, match="failed run must say why"):
        RunRecord.model_validate({**record.model_dump(), "status": "failed"})
    with pytest.raises(ValueError):
        RunRecord.model_validate({**record.model_dump(), "unexpected": 1})
    with pytest.raises(ValueError):
        StepRecord.model_validate(
            {
                "step": 0,
                "loss": 1.0,
                "time_s_max": 1,
                "time_s_mean": 1,
                "comm_s_max": 0,
                "comm_s_mean": 0,
                "samples": 1,
                "timed": True,
            }
        )

    path = tmp_path / "summary.json"
    path.write_text(json.dumps({**record.model_dump(), "throughput": {"samples_per_s": -1}}))
    with pytest.raises(RecordError, match="does not follow the run record schema: throughput"):
        read_summary(path)
    path.write_text(json.dumps({**record.model_dump(), "schema_version": 99}))
    with pytest.raises(RecordError, match="schema_version 99"):
        read_summary(path)
    path.write_text('{"schema_version": 1, ')
    with pytest.raises(RecordError, match="not valid JSON"):
        read_summary(path)
    with pytest.raises(RecordError, match="no run summary"):
        read_summary(tmp_path / "elsewhere")


def test_writer_validates_before_writing(finished_run, tmp_path):
    record, _ = finished_run
    writer = RunWriter(tmp_path / "run")
    broken = record.model_copy(update={"final_loss": None})  # model_copy skips validation
    with pytest.raises(ValueError):
        writer.write_summary(broken)
    assert not writer.summary_path.exists()


def test_a_torn_last_step_line_is_skipped(finished_run, tmp_path):
    _, run_dir = finished_run
    text = (run_dir / "steps.jsonl").read_text()
    torn = tmp_path / "steps.jsonl"
    torn.write_text(text + '{"step": 31, "loss": 0.1, "ti')
    assert len(read_steps(torn)) == 30
    torn.write_text('{"step": 1}\n' + text)
    with pytest.raises(RecordError, match=":1: not a valid step record"):
        read_steps(torn)


def as_v6(record: RunRecord) -> dict:
    """The record as v6 wrote it: no flops, no counted step's memory, no checkpointing mode."""
    data = json.loads(record.model_dump_json())
    data["schema_version"] = 6
    data.pop("flops")
    for field in ("activation_checkpointing", "activation_checkpointing_every", "checkpointed_units"):
        data["memory"].pop(field)
    for field in ("activations_after_forward_bytes", "step_peak"):
        data["memory"].pop(field)
    return data


def test_v6_records_are_migrated_on_read_with_nothing_counted(finished_run, tmp_path):
    record, _ = finished_run
    assert record.flops is not None and record.memory.step_peak is not None  # what v7 counts
    v6 = as_v6(record)
    shipped_v6 = json.loads((ROOT / "analysis/records/run_record.v6.schema.json").read_text())
    jsonschema.validate(v6, shipped_v6)  # a genuine v6 record
    (tmp_path / "summary.json").write_text(json.dumps(v6))
    migrated = read_summary(tmp_path)
    assert migrated.schema_version == 7 and migrated.flops is None and migrated.memory.step_peak is None
    assert migrated.memory.activation_checkpointing is None and migrated.timings == record.timings
    assert json_schema(6) == shipped_v6 and json_schema(7) != shipped_v6


def as_v5(record: RunRecord) -> dict:
    """The record as v5 wrote it: no measurement.baseline (always the whole replica), no
    measurement.outside_load, no compile.graph_breaks, no strategy.adopted, no task.preparation,
    and none of what v6 gained later: comm_bytes, topology.mesh, environment.rank_hosts."""
    data = as_v6(record)
    data["schema_version"] = 5
    data.pop("comm_bytes")
    data["topology"].pop("mesh")
    data["environment"].pop("rank_hosts")
    data["strategy"].pop("adopted")
    data["task"].pop("preparation")
    for field in ("baseline", "outside_load"):
        data["measurement"].pop(field)
    data["compile"].pop("graph_breaks")
    comm = data["comm"]
    if comm["trusted"] == "none":  # v6 gives no figure for a negative reading; v5 trusted it, raw
        comm["trusted"] = "replica"
        data["timings"]["comm_exposed_s"] = comm["replica"]["median_s"]
        data["comm_overhead"] = comm["replica"]["median_s"] / data["timings"]["step_mean_s"]
    return data


def as_early_v5(record: RunRecord) -> dict:
    """The record as v5 was first written: without the model's machine choices (an optional field
    v5 gained on 2026-12-02); the earlier versions' builders start from here."""
    data = as_v5(record)
    data["model"].pop("machine_choices")
    return data


def test_an_early_v5_record_reads_with_the_new_fields_empty(finished_run, tmp_path):
    record, _ = finished_run
    (tmp_path / "summary.json").write_text(json.dumps(as_early_v5(record)))
    read = read_summary(tmp_path)
    assert read.model.machine_choices == {}


def test_v5_records_are_migrated_on_read(finished_run, tmp_path):
    record, _ = finished_run
    v5 = as_v5(record)
    shipped_v5 = json.loads((ROOT / "analysis/records/run_record.v5.schema.json").read_text())
    jsonschema.validate(v5, shipped_v5)  # a genuine v5 record
    (tmp_path / "summary.json").write_text(json.dumps(v5))
    migrated = read_summary(tmp_path)
    # every v5 run timed a whole replica, and none measured the machine's other load
    assert migrated.schema_version == 7 and migrated.measurement.baseline == "replica"
    assert migrated.measurement.outside_load is None
    assert json_schema(5) == shipped_v5 and json_schema(6) != shipped_v5


def test_a_v5_record_of_a_negative_reading_is_read_with_its_raw_figure(finished_run, tmp_path):
    """v5 trusted a method even when it read below zero (v6 gives no figure then); whichever way
    this machine's run read, its v5 form with a negative reading is a valid v5 record that reads."""
    record, _ = finished_run
    # a reading a fifth of the step below zero: v5's comm_overhead (reading / step) lies in [-1, 1]
    # only for readings smaller than the step, and a quickstart step can be short
    below = record.timings.step_mean_s / 5
    replica = record.comm.replica.model_copy(update={"median_s": -below, "low_s": -1.5 * below, "high_s": -0.5 * below})
    negative = record.model_copy(
        update={
            "comm": record.comm.model_copy(
                update={"replica": replica, "check": None, "difference_s": None, "trusted": "none"}
            )
        }
    )
    v5 = as_v5(negative)
    jsonschema.validate(v5, json.loads((ROOT / "analysis/records/run_record.v5.schema.json").read_text()))
    (tmp_path / "summary.json").write_text(json.dumps(v5))
    migrated = read_summary(tmp_path)
    assert migrated.comm.trusted == "replica" and migrated.timings.comm_exposed_s == -below


@pytest.mark.parametrize("compile_s", [None, 4.2])
def test_v4_records_are_migrated_on_read(finished_run, tmp_path, compile_s):
    record, _ = finished_run
    v4 = as_early_v5(record)
    v4["schema_version"] = 4
    v4.pop("compile")
    v4["timings"]["compile_s"] = compile_s
    shipped_v4 = json.loads((ROOT / "analysis/records/run_record.v4.schema.json").read_text())
    jsonschema.validate(v4, shipped_v4)  # a genuine v4 record
    (tmp_path / "summary.json").write_text(json.dumps(v4))
    migrated = read_summary(tmp_path)
    # v4 compiled only the model (model.compile), and recorded a compile time exactly when it did
    assert migrated.schema_version == 7 and migrated.compile.setting == ("none" if compile_s is None else "model")
    assert "schema v4" in migrated.compile.mechanism
    assert json_schema(4) == shipped_v4 and json_schema(6) != shipped_v4


def as_v3(record: RunRecord) -> dict:
    """The record as kanscale 0.3 (schema v3) wrote it: no precision, no data loader."""
    data = as_early_v5(record)
    data["schema_version"] = 3
    data.pop("precision")
    data.pop("compile")
    for field in ("loader", "loader_workers"):
        data["batch"].pop(field)
    return data


def test_v3_records_are_migrated_on_read(finished_run, tmp_path):
    record, _ = finished_run
    v3 = as_v3(record)
    shipped_v3 = json.loads((ROOT / "analysis/records/run_record.v3.schema.json").read_text())
    jsonschema.validate(v3, shipped_v3)  # a genuine v3 record
    (tmp_path / "summary.json").write_text(json.dumps(v3))
    migrated = read_summary(tmp_path)
    assert migrated.schema_version == 7 and migrated.precision.setting == "fp32"
    assert "schema v3" in migrated.precision.mechanism and migrated.batch.loader == "memory"
    assert json_schema(3) == shipped_v3 and json_schema(6) != shipped_v3


def as_v2(record: RunRecord) -> dict:
    """The record as kanscale 0.2 (schema v2) wrote it: one clamped exposed-communication number
    and its check, no spreads, no timing windows."""
    data = as_v3(record)
    data["schema_version"] = 2
    comm = data.pop("comm")
    data["timings"]["comm_exposed_s"] = max(0.0, comm["replica"]["median_s"])
    data["timings"]["comm_exposed_check_s"] = max(0.0, comm["check"]["median_s"]) if comm["check"] else None
    data["comm_overhead"] = data["timings"]["comm_exposed_s"] / data["timings"]["step_mean_s"]
    for section, fields in {
        "measurement": ["timing", "window_steps", "windows"],
        "environment": ["cpu_count"],
        "throughput": ["samples_per_s_low", "samples_per_s_high"],
        "topology": ["threads_per_rank"],
        "memory": ["replica_bytes"],
        "task": ["label", "goal"],
    }.items():
        for field in fields:
            data[section].pop(field)
    return data


def as_v1(record: RunRecord, backend_config: dict | None, name: str, options: dict) -> dict:
    """The record as kanscale 0.1 wrote it: test_mse, no strategy label or reference."""
    data = as_v2(record)
    data["schema_version"] = 1
    data["test_mse"] = data.pop("test_metrics")["mse"]
    data["environment"].pop("slurm_job_id")  # recorded since 0.2
    data["strategy"] = {"name": name, "options": options, "distributed_type": None, "backend_config": backend_config}
    return data


def test_v2_records_are_migrated_on_read(finished_run, tmp_path):
    record, _ = finished_run
    v2 = as_v2(record)
    shipped_v2 = json.loads((ROOT / "analysis/records/run_record.v2.schema.json").read_text())
    jsonschema.validate(v2, {**shipped_v2, "$ref": "#/$defs/RunRecord"})  # a genuine v2 record
    (tmp_path / "summary.json").write_text(json.dumps(v2))
    migrated = read_summary(tmp_path)
    assert migrated.schema_version == 7 and migrated.comm.replica.median_s == v2["timings"]["comm_exposed_s"]
    assert migrated.comm.trusted == "replica" and "clamped at 0" in migrated.comm.note
    assert migrated.measurement.timing == "per_step" and migrated.measurement.windows == record.batch.timed_steps
    assert json_schema(2) == shipped_v2


@pytest.mark.parametrize(
    "name,options,backend_config,label",
    [
        (
            "deepspeed",
            {"zero_stage": 0},
            {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}},
            "zero3_offload",
        ),
        ("fsdp1", {"sharding_strategy": "SHARD_GRAD_OP"}, None, "fsdp1_grad_op"),
        ("single", {}, None, "single"),
    ],
)
def test_v1_records_are_migrated_on_read(finished_run, tmp_path, name, options, backend_config, label):
    record, _ = finished_run
    v1 = as_v1(record, backend_config, name, options)
    shipped_v1 = json.loads((ROOT / "analysis/records/run_record.v1.schema.json").read_text())
    jsonschema.validate(v1, {**shipped_v1, "$ref": "#/$defs/RunRecord"})  # a genuine v1 record
    (tmp_path / "summary.json").write_text(json.dumps(v1))
    migrated = read_summary(tmp_path)
    assert migrated.schema_version == 7 and migrated.test_metrics == {"mse": v1["test_mse"]}
    assert migrated.strategy.label == label and migrated.strategy.reference == (name == "single")
    assert json_schema(1) == shipped_v1 and json_schema(6) != shipped_v1
