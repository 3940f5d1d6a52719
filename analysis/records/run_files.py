"""Reading and writing run records on disk.

A run directory holds ``summary.json`` (the :class:`RunRecord`), ``steps.jsonl`` (one
:class:`StepRecord` per line, appended as training goes) and ``config.yaml`` (the resolved
experiment). The summary is replaced atomically (temp file + rename), so a reader sees either
the previous complete version or the new one, never half a file. A run writes its summary with
status ``incomplete`` before the first step, so a process that is killed leaves a record that
says so. Every file is created as ``open`` creates one (mode 0666 less the umask), so one policy,
the umask, decides who may read a run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import ValidationError

from analysis.records.migrate import migrate
from analysis.records.schema import RunRecord, StepRecord
from kanscale.files import not_utf8
from kanscale.writes import atomic_write_text, open_to_append

SUMMARY_FILE = "summary.json"
STEPS_FILE = "steps.jsonl"
CONFIG_FILE = "config.yaml"


class RecordError(ValueError):
    """A run record that cannot be read or does not follow the schema."""


class RunWriter:
    """Writes one run's directory. Validates every record before it touches the disk."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)

    @property
    def summary_path(self) -> Path:
        return self.run_dir / SUMMARY_FILE

    def write_config(self, yaml_text: str) -> None:
        atomic_write_text(self.run_dir / CONFIG_FILE, yaml_text)

    def write_summary(self, record: RunRecord) -> None:
        checked = RunRecord.model_validate(record.model_dump())
        atomic_write_text(self.summary_path, checked.model_dump_json(indent=2) + "\n")

    def rewrite_steps(self, steps: list[StepRecord]) -> None:
        """Replace steps.jsonl (atomically) with ``steps``: a resumed run drops the steps after
        the checkpoint it resumes from, which it trains again."""
        atomic_write_text(self.run_dir / STEPS_FILE, "".join(s.model_dump_json() + "\n" for s in steps))

    def append_steps(self, steps: list[StepRecord]) -> None:
        lines = "".join(StepRecord.model_validate(s.model_dump()).model_dump_json() + "\n" for s in steps)
        with open_to_append(self.run_dir / STEPS_FILE, binary=True) as f:  # unbuffered: nothing left to flush at close
            start = f.seek(0, os.SEEK_END)
            try:
                data = memoryview(lines.encode())
                while data:  # a raw write may write part and return its length; the next one raises
                    data = data[f.write(data) :]
                os.fsync(f.fileno())
            except OSError:
                f.truncate(
                    start
                )  # a part written before the disk filled would be a torn line mid-file once appended to
                raise


def read_regular(path: Path) -> bytes:
    """A record file's bytes; RecordError for what is not a regular file (a named pipe would block
    the reader forever) or cannot be read."""
    try:
        if not path.is_file():
            raise RecordError(f"{path}: not a regular file, so not a record")
        return path.read_bytes()
    except OSError as err:
        raise RecordError(f"{path}: cannot be read: {err.strerror or err}") from None


def read_summary(path: Path) -> RunRecord:
    """Read and validate ``summary.json`` (the file or its run directory)."""
    path = Path(path)
    if path.is_dir() and path.name != SUMMARY_FILE:  # a run directory (a directory named summary.json is no summary)
        path = path / SUMMARY_FILE
    if not path.exists():
        raise RecordError(f"{path}: no run summary here")
    raw = read_regular(path)
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:  # a damaged file, or not one the suite wrote
        raise RecordError(f"{path}: not a run summary: {not_utf8(raw, err)} (the suite writes UTF-8)") from None
    except json.JSONDecodeError as err:
        raise RecordError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
    except RecursionError:
        raise RecordError(f"{path}: not a run summary: JSON nested too deeply to read") from None
    if not isinstance(data, dict):
        raise RecordError(f"{path}: a run summary holds a JSON object, got {type(data).__name__}")
    try:
        data = migrate(data)
    except ValueError as err:
        raise RecordError(f"{path}: {err}") from None
    try:
        return RunRecord.model_validate(data)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'record'}: {e['msg']}" for e in err.errors())
        raise RecordError(f"{path}: does not follow the run record schema: {problems}") from None


def read_steps(path: Path) -> list[StepRecord]:
    """Read ``steps.jsonl`` (the file or its run directory). A torn last line, left by a process
    killed mid-write, is skipped; any other bad line is an error."""
    path = Path(path)
    if path.is_dir() and path.name != STEPS_FILE:
        path = path / STEPS_FILE
    if not path.exists():
        return []
    raw = read_regular(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RecordError(f"{path}: not UTF-8 text: {not_utf8(raw, err)} (the suite writes UTF-8)") from None
    lines = text.splitlines()
    steps = []
    for n, line in enumerate(lines, start=1):
        try:
            steps.append(StepRecord.model_validate_json(line))
        except ValidationError as err:
            if n == len(lines) and not text.endswith("\n"):
                break
            raise RecordError(f"{path}:{n}: not a valid step record: {err.errors()[0]['msg']}") from None
    return steps
