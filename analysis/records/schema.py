"""Metrics schema v7: the run record (one per run, ``summary.json``) and the step records (one
per optimizer step, ``steps.jsonl``). Every strategy writes exactly these fields; analysis reads
nothing else. Records are validated when written and when read; ``kanscale schema`` prints the
JSON Schema generated from these classes (also shipped as ``analysis/records/run_record.schema.json``).
Records of versions 1 to 6 are migrated when read (analysis/records/migrate.py); their JSON Schemas are
shipped frozen as ``run_record.v<N>.schema.json``.

Units: seconds, bytes, samples. Per-step times are means over the timed (post-warm-up) steps.
Derived quantities (speedup, efficiency, retention, ...) are computed in analysis, never stored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import ConfigDict, Field, model_validator
from pydantic.json_schema import models_json_schema

from analysis.records.schema_sections import (
    BatchInfo,
    CommBytes,
    CommExposure,
    CompileInfo,
    Environment,
    Flops,
    MeasurementInfo,
    Memory,
    ModelInfo,
    ModelStateBytes,
    OutsideLoad,
    PrecisionInfo,
    Record,
    RunError,
    Spread,
    StrategyInfo,
    TaskInfo,
    TensorMemory,
    Throughput,
    Timings,
    Topology,
)

SCHEMA_VERSION: Final = 7
Status = Literal["ok", "failed", "incomplete"]

# The sections are part of this module's public names: writers import every class of a record from here.
__all__ = [
    "FROZEN_SCHEMAS",
    "OK_REQUIRES",
    "SCHEMA_VERSION",
    "BatchInfo",
    "CommBytes",
    "CommExposure",
    "CompileInfo",
    "Environment",
    "Flops",
    "MeasurementInfo",
    "Memory",
    "ModelInfo",
    "ModelStateBytes",
    "OutsideLoad",
    "PrecisionInfo",
    "Record",
    "RunError",
    "RunRecord",
    "Spread",
    "Status",
    "StepRecord",
    "StrategyInfo",
    "TaskInfo",
    "TensorMemory",
    "Throughput",
    "Timings",
    "Topology",
    "json_schema",
]


# What a finished (ok) run must hold besides the fields every record has.
OK_REQUIRES = ("timings", "throughput", "comm", "measurement", "memory", "final_loss", "test_metrics", "finished_at")


class RunRecord(Record):
    # The conditions of _complete_when_ok, for the JSON Schema's readers.
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "allOf": [
                {
                    "if": {"properties": {"status": {"const": "ok"}}, "required": ["status"]},
                    "then": {
                        "required": list(OK_REQUIRES),
                        "properties": {f: {"not": {"type": "null"}} for f in OK_REQUIRES},
                    },
                },
                {
                    "if": {"properties": {"status": {"const": "failed"}}, "required": ["status"]},
                    "then": {"required": ["error"]},
                },
            ]
        },
    )
    schema_version: Literal[7] = SCHEMA_VERSION
    run_id: str
    name: str
    status: Status
    error: RunError | None = None
    study: str | None = None
    config_digest: str = Field(description="hash of the resolved config; equal digests mean equal experiments")
    started_at: str
    finished_at: str | None = None
    resumed_at_steps: list[int] = Field(
        default_factory=list, description="steps from whose checkpoints the run was resumed"
    )
    seed: int
    strategy: StrategyInfo
    model: ModelInfo
    task: TaskInfo
    topology: Topology
    batch: BatchInfo
    timings: Timings | None = None
    throughput: Throughput | None = None
    comm_overhead: float | None = Field(
        None, ge=-1.0, le=1.0, description="comm_exposed_s / step time; None where comm_exposed_s is (see comm)"
    )
    comm: CommExposure | None = None
    comm_bytes: CommBytes | None = Field(
        None,
        description="bytes one step moved inside and across nodes; None for one "
        "process, a compiled run, or none warm-up step to count on",
    )
    measurement: MeasurementInfo | None = None
    memory: Memory | None = None
    flops: Flops | None = Field(
        None, description="FLOPs per sample of the counted step; None where none was counted (as memory's)"
    )
    final_loss: float | None = Field(None, description="training loss of the last step (global mean)")
    test_metrics: dict[str, float] | None = Field(None, description="the task's named test metrics, e.g. mse")
    precision: PrecisionInfo
    compile: CompileInfo
    environment: Environment

    @model_validator(mode="after")
    def _complete_when_ok(self) -> RunRecord:
        if self.status == "ok":
            missing = [f for f in OK_REQUIRES if getattr(self, f) is None]
            if missing:
                raise ValueError(f"a run with status ok must have {', '.join(missing)}")
        if self.status == "failed" and self.error is None:
            raise ValueError("a failed run must say why in error")
        return self


class StepRecord(Record):
    step: int = Field(ge=1)
    loss: float = Field(description="global mean training loss of the step")
    lr: float | None = Field(
        None,
        description="the learning rate the optimizer stepped with (training.schedule), read "
        "from it on rank 0; None in records written before it was recorded",
    )
    time_s_max: float = Field(ge=0.0, description="step time, slowest rank")
    time_s_mean: float = Field(ge=0.0)
    comm_s_max: float | None = Field(
        None,
        description="exposed communication (step - data - compute, raw), largest over "
        "ranks; None without a compute baseline (measurement.baseline off)",
    )
    comm_s_mean: float | None = None
    compute_s: float | None = Field(
        None, ge=0.0, description="the replica's compute time after this step's window, mean over ranks"
    )
    window: int | None = Field(None, ge=0, description="the timing window the step belongs to")
    samples: int = Field(ge=0, description="global samples in the step")
    timed: bool = Field(description="false for warm-up steps")


def json_schema(version: int = SCHEMA_VERSION) -> dict[str, Any]:
    """The JSON Schema of the run record (the root: what ``summary.json`` holds), with the step
    record beside it under ``$defs/StepRecord`` (each line of ``steps.jsonl``): generated from
    these classes for the current version, the shipped frozen files for earlier ones."""
    if version in FROZEN_SCHEMAS:
        return json.loads((Path(__file__).parent / FROZEN_SCHEMAS[version]).read_text())
    if version != SCHEMA_VERSION:
        raise ValueError(
            f"no schema version {version}; there are {', '.join(map(str, [*FROZEN_SCHEMAS, SCHEMA_VERSION]))}"
        )
    _, schema = models_json_schema([(RunRecord, "validation"), (StepRecord, "validation")])
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://kanscale.invalid/schema/v{SCHEMA_VERSION}",
        "title": f"kanscale metrics schema v{SCHEMA_VERSION}",
        "description": "summary.json holds one run record (this schema's root); steps.jsonl holds one "
        "#/$defs/StepRecord per line.",
        "$ref": "#/$defs/RunRecord",
        **schema,
    }


# Earlier versions' schemas, as they were shipped (without a root: validate against $defs/RunRecord).
FROZEN_SCHEMAS = {v: f"run_record.v{v}.schema.json" for v in (1, 2, 3, 4, 5, 6)}
