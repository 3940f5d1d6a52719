"""Rehearsals (strategies/rehearsal/, ``kanscale rehearse``) against what real runs record: each
strategy's model state and collectives (count and bytes per step) exactly, at 1, 2 and 4 ranks,
and the peak of tensor memory against the same step measured inside a real process group
(docs/rehearsal.md)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launchers.cli import main
from tests.helpers.launch import ROOT, child_env, run, run_jobs
from tests.helpers.parity import STRATEGIES
from tests.helpers.state_runs import DISTRIBUTED, state_experiment

COMM_FIELDS = ("intra_node_bytes", "inter_node_bytes", "intra_node_collectives", "inter_node_collectives")


def rehearse(
    tmp: Path, experiment: dict, strategies: list[str], nnodes: int, per_node: int, rank: int = 0
) -> dict[str, dict]:
    """``kanscale rehearse`` of ``experiment`` under the test strategies named, as a user runs it;
    the rehearsals by the name given."""
    exp = tmp / "experiment.yaml"
    exp.write_text(yaml.safe_dump(experiment))
    files = []
    for name in strategies:
        files.append(tmp / f"{name}.yaml")
        files[-1].write_text(yaml.safe_dump(STRATEGIES.get(name, {"name": name})))
    out = tmp / f"rehearsal-{nnodes}x{per_node}-{rank}.json"
    command = [sys.executable, "-m", "launchers.cli", "rehearse", str(exp), "--strategies", ",".join(map(str, files))]
    command += ["--nnodes", str(nnodes), "--nproc-per-node", str(per_node), "--rank", str(rank), "--json", str(out)]
    proc = run(command, timeout=600)
    doc = json.loads(out.read_text())
    assert not doc["refusals"], proc.stdout
    assert "per rank and step" in proc.stdout and "| strategy | mesh |" in proc.stdout
    return dict(zip(strategies, doc["rehearsals"], strict=True))


def most_of(*ranks: dict) -> dict:
    """The ranks' rehearsals as a record gives a run: the largest of each figure over the ranks."""
    state = {k: max(r["model_state"][k] for r in ranks) for k in ranks[0]["model_state"]}
    comm = ranks[0]["comm"] and {k: max(r["comm"][k] for r in ranks) for k in COMM_FIELDS}
    return {**ranks[0], "model_state": state, "comm": comm}


def assert_as_recorded(rehearsal: dict, record: dict, label: str) -> None:
    assert rehearsal["model_state"] == record["model_state"], label
    if record["comm_bytes"] is None:
        assert rehearsal["comm"] is None, label
    else:
        assert {k: rehearsal["comm"][k] for k in COMM_FIELDS} == {k: record["comm_bytes"][k] for k in COMM_FIELDS}, (
            label
        )
        assert sum(c["calls"] for c in rehearsal["collectives"]) == sum(
            record["comm_bytes"][k] for k in COMM_FIELDS[2:]
        ), label


def assert_every_rank_as_recorded(tmp: Path, state_runs: dict, precision: str, as_rank_1: list[str]) -> None:
    """Each strategy rehearsed as rank 0, and those of ``as_rank_1`` as rank 1 too, against the
    2-rank runs' records (the largest figure over the ranks)."""
    experiment = state_experiment("ddp", tmp / "o", precision)
    first = rehearse(tmp, experiment, DISTRIBUTED, 1, 2, 0)
    second = rehearse(tmp, experiment, as_rank_1, 1, 2, 1)
    for name in DISTRIBUTED:
        assert_as_recorded(
            most_of(first[name], *([second[name]] if name in second else [])), state_runs[precision, name], name
        )
    (single,) = rehearse(tmp, state_experiment("single", tmp / "o", precision), ["single"], 1, 1).values()
    assert_as_recorded(single, state_runs[precision, "single"], "single")
    assert single["memory"]["activations"] > 0 and single["flops"] > 0 and single["kernels"] > 0
    # the kernels grouped by phase, as the device-time model costs them: every one, each phase seen
    assert sum(k["count"] for k in single["ops"]) == single["kernels"]
    assert {k["phase"] for k in single["ops"]} == {"forward", "backward", "optimizer"}
    assert sum(k["flops"] * k["count"] for k in single["ops"]) == pytest.approx(single["flops"])


def test_every_strategy_rehearses_as_its_two_rank_run_records_at_one_and_two_ranks(state_runs, tmp_path):
    """A record gives the largest figure over the ranks; FSDP1 splits its flat parameter by
    position, so its ranks hold state for different numbers of tensors: rank 1 is rehearsed too
    (ZeRO-3 only as rank 0: see test_a_rank_whose_backend_checks_rank_0s_values_says_so)."""
    assert_every_rank_as_recorded(tmp_path, state_runs, "fp32", [k for k in DISTRIBUTED if not k.startswith("zero3")])


@pytest.mark.slow  # every strategy rehearsed in bf16
def test_bf16_rehearses_as_recorded(state_runs, tmp_path):
    assert_every_rank_as_recorded(tmp_path, state_runs, "bf16", ["fsdp1"])  # whose ranks hold different shares


@pytest.mark.slow  # a 4-rank launch as two nodes
def test_four_ranks_on_two_nodes_rehearse_as_recorded(tmp_path):
    names = ["ddp", "fsdp2", "zero2", "zero3"]
    jobs = [{"id": k, "config": state_experiment(k, tmp_path / "r", "fp32")} for k in names]
    results = run_jobs(jobs, tmp_path, nproc=2, nnodes=2)
    experiment = state_experiment("ddp", tmp_path / "o", "fp32")
    rehearsed = rehearse(tmp_path, experiment, names, 2, 2)
    for name in names:  # even shards: rank 0 holds what every rank does
        assert rehearsed[name]["comm"]["inter_node_collectives"] > 0, name
        assert_as_recorded(rehearsed[name], results[name], name)


@pytest.mark.slow  # a real 2-rank group beside the fake one
def test_the_tensor_peak_is_the_real_groups_within_ten_percent(tmp_path):
    """The same step measured inside a real 2-rank gloo group: the fake group changes no figure
    but the time and a few kernels (collective outputs are left unfilled, which no shape depends on)."""
    names = ["ddp", "fsdp1", "fsdp2", "zero2", "zero3"]
    experiments = [state_experiment(k, tmp_path / "o", "fp32") for k in names]
    (tmp_path / "experiments.json").write_text(json.dumps(experiments))
    worker = [str(ROOT / "tests/helpers/real_step.py"), str(tmp_path / "experiments.json"), str(tmp_path / "real.json")]
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *worker], timeout=600)
    real = dict(zip(names, json.loads((tmp_path / "real.json").read_text()), strict=True))
    rehearsed = rehearse(tmp_path, experiments[0], names, 1, 2)
    for name in names:
        fake, measured = rehearsed[name], real[name]
        assert fake["model_state"] == measured["model_state"] and fake["comm"] == measured["comm"], name
        assert abs(fake["memory"]["peak"] - measured["memory"]["peak"]) <= 0.1 * measured["memory"]["peak"], name
        # gloo copies a few tensors through the dispatcher where the fake group does not
        assert (
            fake["flops"] == measured["flops"]
            and abs(fake["kernels"] - measured["kernels"]) <= 0.02 * measured["kernels"]
        )


def test_a_rank_whose_backend_checks_rank_0s_values_says_so(tmp_path):
    """ZeRO-3 checks a list's length against the one rank 0 broadcasts, which a fake group does
    not deliver: rehearsing another rank is refused as the rehearsal's limit, not the layout's."""
    exp = tmp_path / "experiment.yaml"
    exp.write_text(yaml.safe_dump(state_experiment("ddp", tmp_path / "o", "fp32")))
    out = tmp_path / "r.json"
    command = [sys.executable, "-m", "launchers.cli", "rehearse", str(exp), "--strategies", "zero3", "--rank", "1"]
    proc = subprocess.run([*command, "--json", str(out)], capture_output=True, text=True, cwd=ROOT, env=child_env())
    assert proc.returncode == 1, proc.stderr  # nothing rehearsed
    (refusal,) = json.loads(out.read_text())["refusals"]
    assert "as rank 1" in refusal["reason"] and "rehearse as rank 0" in refusal["reason"], refusal


def test_what_a_launch_would_refuse_is_named_per_strategy_and_bad_options_before_any(tmp_path, capsys):
    exp = tmp_path / "experiment.yaml"
    exp.write_text(yaml.safe_dump(state_experiment("ddp", tmp_path / "o", "fp32")))
    base = [sys.executable, "-m", "launchers.cli", "rehearse", str(exp)]
    out = tmp_path / "r.json"
    # tensor parallelism of degree 2 cannot cut a 3-rank world; single trains in one process
    three = ["--nproc-per-node", "3", "--set", "training.global_batch=66"]
    proc = run([*base, *three, "--strategies", "fsdp2_tp,single,fsdp2", "--json", str(out)])
    refused = {r["strategy"]: r["reason"] for r in json.loads(out.read_text())["refusals"]}
    assert set(refused) == {"fsdp2_tp", "single"} and "tp_degree" in refused["fsdp2_tp"], refused
    assert "fsdp2_tp" in proc.stdout and "Not rehearsed" in proc.stdout
    for argv, named in [
        (["--rank", "4", "--nproc-per-node", "4"], "--rank"),
        (["--set", "training.lr=-1"], "training.lr"),
        (["--strategies", "no_such_preset"], "no_such_preset"),
        (["--json", str(tmp_path / "r.txt")], "--json"),
    ]:
        assert main(["rehearse", str(exp), *argv]) == 2, argv
        err = capsys.readouterr().err
        assert named in err and "rehearsing" not in err, (argv, err)


@pytest.mark.slow  # pykan built and rehearsed under four backends
def test_a_model_with_frozen_parameters_rehearses_under_every_kind_of_backend(tmp_path):
    # pykan holds masks and grids as parameters without gradients, which take no gradient hook
    experiment = {
        "name": "pykan-frozen",
        "model": {"family": "pykan", "widths": [2, 4, 1], "grid": 5},
        "task": {"name": "quadratic", "n_train": 256, "n_test": 64},
        "training": {"micro_batch": 16, "steps": 4, "warmup_steps": 2},
    }
    done = rehearse(tmp_path, experiment, ["ddp", "fsdp1", "fsdp2", "zero3"], 1, 4)
    for name, x in done.items():
        assert x["memory"]["parameters"] > 0 and x["kernels"] > 500, (name, x["memory"], x["kernels"])
    assert done["ddp"]["memory"]["gradients"] > 0
