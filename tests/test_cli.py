"""The kanscale CLI as a user runs it, a config given as a pipe included: `kanscale run` refuses
it before launch (the ranks cannot read it again), `kanscale train` in one process reads it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.records.run_files import read_steps, read_summary
from launchers.cli import main
from tests.helpers.cli import refused

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "configs/experiments/quickstart.yaml")
PAPER = str(ROOT / "configs/experiments/paper_kan64.yaml")


def only_run(out: Path) -> Path:
    runs = [p for p in out.iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def test_train_prints_a_summary_and_writes_a_valid_record(tmp_path, capsys):
    assert main(["train", QUICKSTART, "--out", str(tmp_path), "--set", "training.epochs=1", "--no-progress"]) == 0
    out = capsys.readouterr()
    record = read_summary(only_run(tmp_path))
    assert record.status == "ok" and record.strategy.name == "single"
    for text in ("bspline [2, 16, 1]", "samples/s", "test mse", "summary.json", record.run_id):
        assert text in out.out
    assert "[kanscale] step" in out.err  # compact log lines when not on a terminal
    assert record.final_loss < read_steps(only_run(tmp_path))[0].loss
    # what ran, where: this CPU, and what the fast layer's product auto became on it
    from kanscale.machine import cpu_model

    assert record.topology.device_name == cpu_model()
    assert record.model.options["product"] == "auto"
    assert record.model.machine_choices["product"].startswith(
        "dense: 2.0 bases per non-zero against a crossover of 20.0"
    )  # (5 + 3) / 4


def test_paper_config_trains_the_pykan_model(tmp_path, capsys, in_tmp_cwd):
    # The study's model and task, shortened: pykan [2, 64, 1], grid 10, k 3, batch 512.
    code = main(
        [
            "train",
            PAPER,
            "--out",
            str(tmp_path / "runs"),
            "--no-progress",
            "--set",
            "task.n_train=4096",
            "--set",
            "task.n_test=512",
            "--set",
            "training.epochs=2",
        ]
    )
    assert code == 0
    record = read_summary(only_run(tmp_path / "runs"))
    assert (record.model.family, record.model.params_total, record.batch.micro_batch) == ("pykan", 5414, 512)
    assert record.batch.steps == 16 and record.environment.pykan == "0.2.8"
    assert sorted(p.name for p in in_tmp_cwd.iterdir()) == ["runs"]  # pykan wrote nothing else


@pytest.mark.parametrize(
    "args,message",
    [
        (["--set", "training.lrr=1"], "training.lrr: unknown key; did you mean 'lr'"),
        (
            ["--set", "training.warmup_steps=500", "--set", "training.steps=10"],
            "training.warmup_steps: 500 warm-up steps leave none",
        ),
        (["--set", "model.k=0"], "model.k"),
    ],
)
def test_bad_input_exits_2_with_one_message_and_no_traceback(tmp_path, capsys, args, message):
    assert main(["train", QUICKSTART, "--out", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # nothing was started


def test_output_dir_that_is_a_file(tmp_path, capsys):
    target = tmp_path / "taken"
    target.write_text("")
    assert main(["train", QUICKSTART, "--out", str(target)]) == 2
    assert "output.dir" in capsys.readouterr().err


def test_missing_config_through_the_console_script(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "launchers.cli", "train", str(tmp_path / "none.yaml")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_models_lists_every_family_with_counts(capsys):
    assert main(["models", "--widths", "2,64,1"]) == 0
    out = capsys.readouterr().out
    for family in ("bspline", "rbf", "chebyshev", "pykan", "mlp"):
        assert family in out
    assert "5,414" in out  # pykan at the study's size (its defaults: grid 10, k 3)


def test_models_rejects_bad_widths(capsys):
    assert main(["models", "--widths", "2,x"]) == 2
    assert "--widths" in capsys.readouterr().err


def test_schema_prints_json_schema(capsys):
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert {"RunRecord", "StepRecord"} <= set(schema["$defs"])


def test_a_native_deepspeed_json_from_the_command_line(tmp_path, capsys):
    """``--deepspeed-config FILE``: the dry run shows the merged config, the ranks get the file,
    and a real run records what the file decided (stage 3)."""
    native = tmp_path / "ds.json"
    native.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}))
    assert main(["run", QUICKSTART, "--deepspeed-config", str(native), "--nproc-per-node", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "# the DeepSpeed config every rank passes to deepspeed.initialize:" in out
    assert '#       "stage": 3,' in out and '"train_batch_size": 512' in out and str(native) in out.splitlines()[-1]
    assert main(["run", QUICKSTART, "--deepspeed-config", str(native), "--strategy", "ddp", "--dry-run"]) == 2
    assert "cannot be combined with --strategy" in capsys.readouterr().err
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "launchers.cli",
            "train",
            QUICKSTART,
            "--deepspeed_config",
            str(native),
            "--no-progress",
            "--set",
            "training.steps=6",
            "--set",
            "training.warmup_steps=1",
            "--set",
            "measurement.baseline_steps=1",
            "--out",
            str(tmp_path / "runs"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = read_summary(only_run(tmp_path / "runs"))
    assert (record.strategy.label, record.strategy.options["zero_stage"]) == ("zero3", 3)


def pipe_of(text: str) -> str:
    """/dev/fd/N of a pipe holding ``text``, as bash's <(...) gives (this process's only)."""
    read, write = os.pipe()
    os.write(write, text.encode())
    os.close(write)
    return f"/dev/fd/{read}"


def test_run_refuses_a_config_the_ranks_cannot_read_again(tmp_path, capsys):
    piped = pipe_of(Path(QUICKSTART).read_text())
    err = refused(["run", piped, "--strategy", "ddp", "--nproc-per-node", "2", "--dry-run"], capsys)
    assert f"config: {piped} is not a regular file" in err and "write it to a file first" in err
    fifo = tmp_path / "ds.json"
    os.mkfifo(fifo)  # no writer: reading it would block, so it must be refused unread
    err = refused(["run", QUICKSTART, "--deepspeed-config", str(fifo), "--nproc-per-node", "2", "--dry-run"], capsys)
    assert f"--deepspeed-config: {fifo} is not a regular file" in err
    err = refused(
        ["run", QUICKSTART, "--strategy", "accelerate", "--accelerate-config", str(fifo), "--dry-run"], capsys
    )
    assert f"--accelerate-config: {fifo} is not a regular file" in err


def test_train_in_one_process_still_reads_a_pipe(tmp_path, capsys):
    piped = pipe_of(Path(QUICKSTART).read_text())
    assert (
        main(
            [
                "train",
                piped,
                "--set",
                "training.steps=6",
                "--set",
                "training.epochs=null",
                "--set",
                "measurement.baseline_steps=1",
                "--no-progress",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    assert len(list(tmp_path.glob("*/summary.json"))) == 1
