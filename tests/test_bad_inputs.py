"""Bad input, refused before any process starts with one message naming the field and the fix,
and no traceback: the malformed-input corpus (tests/bad_inputs/), and what the corpus cannot
express: paths built at test time (a file in the output path, a read-only directory), warnings,
records on disk, and the checks' boundaries (what must still be accepted)."""

import importlib.util
import json
import os
from pathlib import Path

import pytest
import yaml

from analysis.records.load import load_runs
from kan_models import FAMILIES, build_model, count_parameters, parse_model_config
from kanscale.errors import ConfigError
from kanscale.files import read_json, read_yaml
from launchers.cli import main
from launchers.studies.point import REASON_CHARS, one_line
from strategies.backends.accelerate_launch import unknown_launch_keys
from strategies.backends.deepspeed_config import resolve_native
from strategies.experiment import load_experiment
from strategies.lifecycle.preflight import ThreadsBeyondCores, training_state_bytes
from strategies.sections import TrainingConfig
from tests.helpers.launch import free_port
from tests.helpers.records import make_record, write_record

BAD = Path(__file__).resolve().parent / "bad_inputs"
# cases.yaml and any cases_<topic>.yaml beside it
CASES = [case for path in sorted(BAD.glob("cases*.yaml")) for case in yaml.safe_load(path.read_text())]


def test_the_corpus_is_large_enough():
    assert len(CASES) >= 25 and len({c["name"] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_bad_input_is_refused_before_launch(case, tmp_path, monkeypatch, capsys):
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    out_file = tmp_path / "taken"
    out_file.write_text("")
    fill = {"{out_dir}": str(tmp_path / "out"), "{out_file}": str(out_file)}
    args = [str(BAD / a) if (BAD / a).is_file() else fill.get(a, a) for a in case["command"]]
    if args[0] in ("train", "run") and "--out" not in args:
        args += ["--out", str(tmp_path / "out")]
    try:
        code = main(args)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    err = capsys.readouterr().err
    expected = case["expect"].replace("{out_file}", str(out_file))
    assert code != 0
    assert expected in err, err
    assert "Traceback" not in err
    assert len([line for line in err.splitlines() if line.startswith(("kanscale: error", "kanscale:", "usage:"))]) <= 2
    assert not (tmp_path / "out").exists() and list(workdir.iterdir()) == []  # nothing was started or written


ROOT = Path(__file__).resolve().parents[1]
VALID = str(BAD / "valid_experiment.yaml")


def refused(argv: list[str], capsys) -> str:
    """Run the CLI, check it refused with one message and no traceback, return the message."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("kanscale: error: ")
    return err


def test_duplicate_keys_are_refused_but_a_merge_may_be_overridden(tmp_path):
    twice = tmp_path / "twice.yaml"
    twice.write_text("a: 1\nb:\n  c: 1\n  d: 2\n  c: 3\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'c' \(lines 3 and 5\)"):
        read_yaml(twice)
    merged = tmp_path / "merged.yaml"
    merged.write_text("base: &base {lr: 0.1, steps: 5}\nrun:\n  <<: *base\n  lr: 0.2\n")
    assert read_yaml(merged)["run"] == {"lr": 0.2, "steps": 5}
    nested = tmp_path / "nested.json"
    nested.write_text('{"fp16": {"enabled": false}, "bf16": {"enabled": false},\n "bf16": {}}')
    with pytest.raises(ConfigError, match='duplicate key "bf16" in one object'):
        read_json(nested)
    # the same key in two different objects is no duplicate
    ok = tmp_path / "ok.json"
    ok.write_text('{"fp16": {"enabled": false}, "bf16": {"enabled": false}}')
    assert read_json(ok) == {"fp16": {"enabled": False}, "bf16": {"enabled": False}}


def test_a_file_in_the_output_path_is_refused_before_launch(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("")
    err = refused(["run", VALID, "--nproc-per-node", "2", "--out", str(taken / "runs")], capsys)
    assert f"output.dir: {taken / 'runs'} cannot be created: {taken} is a file" in err
    err = refused(["sweep", str(BAD / "input_study_unplannable.yaml"), "--out", str(taken / "sweep")], capsys)
    assert f"--out: {taken / 'sweep'} cannot be created: {taken} is a file" in err
    assert taken.read_text() == ""


@pytest.fixture
def read_only_dir(tmp_path) -> Path:
    """A directory this user cannot write: a chmod'ed one, or for root (whom modes do not stop)
    /proc/sys, which the kernel keeps read-only."""
    if os.geteuid() != 0:
        path = tmp_path / "read-only"
        path.mkdir()
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
    elif Path("/proc/sys").is_dir() and not os.access("/proc/sys", os.W_OK):
        yield Path("/proc/sys")
    else:
        pytest.skip("no directory here is read-only for this user")


def test_a_read_only_output_directory_is_refused_before_launch(read_only_dir, capsys):
    out = read_only_dir / "kanscale-runs"
    err = refused(["run", VALID, "--nproc-per-node", "2", "--out", str(out)], capsys)
    assert f"output.dir: {out} cannot be written: {read_only_dir}, where it would be created, is not writable" in err
    err = refused(["run", VALID, "--nproc-per-node", "2", "--out", str(read_only_dir)], capsys)
    assert f"output.dir: {read_only_dir} cannot be written: it is not writable" in err
    assert not out.exists()


def test_export_refuses_an_output_path_through_a_file(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("")
    err = refused(["export", str(tmp_path / "no-run"), "--out", str(taken / "model.pt")], capsys)
    assert f"--out: {taken} is a file" in err


def test_threads_beyond_the_cores_are_warned_about_not_refused(capsys):
    threads = 4 * (os.cpu_count() or 1)
    with pytest.warns(ThreadsBeyondCores, match=rf"runtime.threads: {threads} thread\(s\) x 2 rank\(s\)"):
        assert main(["run", VALID, "--nproc-per-node", "2", "--set", f"runtime.threads={threads}", "--dry-run"]) == 0
    assert "torch.distributed.run" in capsys.readouterr().out


def test_a_batch_of_the_whole_training_set_is_still_accepted(tmp_path, capsys):
    # valid_experiment: n_train 1024; 512 per rank x 2 ranks is the whole set, one more sample is not
    assert (
        main(
            [
                "run",
                VALID,
                "--nproc-per-node",
                "2",
                "--set",
                "training.micro_batch=512",
                "--dry-run",
                "--out",
                str(tmp_path / "out"),
            ]
        )
        == 0
    )
    err = refused(
        [
            "run",
            VALID,
            "--nproc-per-node",
            "2",
            "--set",
            "training.micro_batch=null",
            "--set",
            "training.global_batch=1026",
            "--out",
            str(tmp_path / "out"),
        ],
        capsys,
    )
    assert "lower training.global_batch to at most 1024" in err


def test_two_nodes_with_an_address_or_on_this_machine_are_accepted(tmp_path, capsys):
    base = ["run", VALID, "--nnodes", "2", "--dry-run", "--out", str(tmp_path / "out")]
    base += ["--master-port", str(free_port())]
    assert main([*base, "--master-addr", "10.0.0.1"]) == 0
    assert "--rdzv_endpoint=10.0.0.1:" in capsys.readouterr().out
    # a host list of this machine's names: node 0 is 127.0.0.1 indeed
    assert (
        main(
            [
                *base[:2],
                "--strategy",
                "zero2",
                "--launcher",
                "deepspeed",
                "--hosts",
                "localhost,127.0.0.1",
                "--no-ssh",
                "--dry-run",
                "--out",
                str(tmp_path / "out"),
                "--master-port",
                str(free_port()),
            ]
        )
        == 0
    )
    err = refused([*base, "--node-rank", "1"], capsys)
    assert "give --master-addr NODE0" in err


def test_the_state_estimate_counts_without_building():
    cfg = load_experiment(VALID)  # bspline [2, 8, 1], adam, float32
    real = count_parameters(build_model(cfg.model, seed=0))
    assert training_state_bytes(cfg) == 4 * (real.total + 3 * real.trainable)
    sgd = cfg.model_copy(update={"training": TrainingConfig(optimizer="sgd", dtype="float64", steps=20)})
    assert training_state_bytes(sgd) == 8 * (real.total + real.trainable)
    for family in FAMILIES:
        model = parse_model_config({"family": family, "widths": [2, 6, 1]})
        built = count_parameters(build_model(model, seed=0))
        counted = model.parameter_count()
        # exact where the model builds on the meta device; pykan's is a lower bound
        assert counted == built if family != "pykan" else counted.trainable <= built.trainable


def test_misspelled_deepspeed_keys_are_refused_unknown_ones_warned():
    training = TrainingConfig(micro_batch=8, steps=4)
    native = {
        "zero_optimisation": {"stage": 2},
        "activation_checkpointing": {},  # read as training.activation_checkpointing, not passed on
        "flops_profiler": {"enabled": False},
        "zero_optimization": {"stage": 1, "overlap_com": True, "stage3_model_persistence_threshold": 0},
    }
    resolution = resolve_native(native, training, 2, 8, "ds.json")
    assert any(
        "zero_optimisation is not a DeepSpeed key; did you mean zero_optimization?" in p for p in resolution.problems
    )
    assert any(
        "zero_optimization.overlap_com is not a DeepSpeed key; did you mean zero_optimization.overlap_comm?" in p
        for p in resolution.problems
    )
    assert resolution.unchecked == ["flops_profiler", "zero_optimization.stage3_model_persistence_threshold"]
    assert "activation_checkpointing" not in resolution.config
    if importlib.util.find_spec("deepspeed") is None:
        return
    # no ZeRO key DeepSpeed itself knows (its aliases and older names too) is taken for a misspelling
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = DeepSpeedZeroConfig.model_fields
    keys = set(zero) | {field.alias for field in zero.values() if field.alias}
    resolution = resolve_native({"zero_optimization": dict.fromkeys(keys)}, training, 1, 8, "ds")
    assert not [p for p in resolution.problems if "is not a DeepSpeed key" in p]


def test_shipped_accelerate_configs_hold_only_keys_accelerate_knows():
    pytest.importorskip("accelerate")
    paths = sorted((ROOT / "configs" / "accelerate").glob("*.yaml")) + sorted(
        (ROOT / "tests" / "data").rglob("accelerate*.yaml")
    )
    assert paths and {str(p): unknown_launch_keys(read_yaml(p)) for p in paths} == {str(p): [] for p in paths}
    assert unknown_launch_keys({"distributed_type": "FSDP", "fsdp_config": {"version": 2, "fsdp_versoin": 2}}) == [
        "fsdp_config.fsdp_versoin: not a key accelerate knows (accelerate launch ignores it); "
        "did you mean fsdp_version?"
    ]


def test_a_failed_point_keeps_its_whole_bounded_reason(tmp_path):
    assert (
        one_line("x.yaml is invalid:\n  - training.lr: too low\n  - model.grid: too high")
        == "x.yaml is invalid: - training.lr: too low - model.grid: too high"
    )
    long = one_line("y" * (10 * REASON_CHARS))
    assert len(long) < REASON_CHARS + 40 and long.endswith(f"({9 * REASON_CHARS} more characters)")
    out = tmp_path / "sweep"
    assert main(["sweep", str(BAD / "input_study_unplannable.yaml"), "--out", str(out)]) == 1
    (entry,) = [json.loads(line) for line in (out / "sweep.jsonl").read_text().splitlines()]
    assert entry["status"] == "failed" and "training.lr: Input should be greater than 0 (given: -1)" in entry["detail"]


def test_analyze_skips_a_summary_that_is_not_utf8(tmp_path, capsys):
    runs = tmp_path / "runs"
    write_record(runs, make_record("good"))
    bad = write_record(runs, make_record("bad")) / "summary.json"
    bad.write_bytes(bad.read_bytes().replace(b'"hand"', b'"h\xe4nd"'))  # Latin-1, as a foreign tool might write
    table, problems = load_runs(runs)
    assert list(table["run_id"]) == ["good"]
    assert [p.path for p in problems] == [bad] and "is not UTF-8" in problems[0].message
    assert main(["analyze", str(runs), "--out", str(tmp_path / "report")]) == 0
    assert f"not analysed: {bad}: not a run summary: byte 0xe4" in capsys.readouterr().err


def test_non_finite_numbers_are_refused_in_every_section(tmp_path):
    data = yaml.safe_load(Path(VALID).read_text())
    for path, value in [
        ("training.lr", ".inf"),
        ("training.betas", "[0.9, .nan]"),
        ("measurement.baseline_steps", ".inf"),
        ("runtime.timeout_s", "-.inf"),
        ("model.grid_range", "[-.inf, 1]"),
        ("task.noise_std", ".nan"),
    ]:
        config = tmp_path / "c.yaml"
        config.write_text(yaml.safe_dump(data))
        with pytest.raises(ConfigError, match=r"Input should be a finite number"):
            load_experiment(config, [f"{path}={value}"])
