"""A cluster file is checked whole before anything else is read or measured: one refusal lists
every problem of the file (unknown and misspelled keys, counts that are not whole, numbers not
positive and finite, ranges that do not hold, links the requested layout needs), each with what
to write instead; the shipped files pass, and a file fixed as the refusal says is accepted."""

from pathlib import Path

import pytest
import yaml

from analysis.projection.cluster_file import cluster_problems
from launchers.cli import main
from tests.helpers.launch import ROOT

A100 = ROOT / "configs/clusters/a100_ib.yaml"
SHIPPED = sorted((ROOT / "configs/clusters").glob("*.yaml"))


def a100() -> dict:
    return yaml.safe_load(A100.read_text())


def write(tmp_path: Path, doc: dict) -> str:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def recommend(cluster: str, tmp_path: Path, *flags: str) -> list[str]:
    return ["recommend", "quickstart", "--cluster", cluster, "--out", str(tmp_path / "rec"), *flags]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_the_shipped_cluster_files_have_no_problem(path):
    doc = yaml.safe_load(path.read_text())
    assert cluster_problems(doc, {"inter", "intra", "host", "device_memory_GiB"}) == []


def test_one_refusal_lists_every_problem_of_the_file_before_anything_runs(tmp_path, capsys):
    doc = a100()
    doc["ranks_per_node"] = 0
    doc["overlap"] = "yes"
    doc["device_memory_GiB"] = -40
    doc["devce_tflops"] = doc.pop("device_tflops")
    del doc["links"]["inter"]["alpha_us"]
    doc["links"]["intr"] = doc["links"].pop("intra")
    doc["memory_bandwidth_GBps"] = {"value": 1555, "low": 2000, "high": 1800}
    assert main(recommend(write(tmp_path, doc), tmp_path, "--nnodes", "2")) == 2
    err = capsys.readouterr().err
    for says in (
        "has 8 problem(s); fix each:",
        "devce_tflops: unknown key; did you mean device_tflops?",
        "ranks_per_node is 0; give a whole number from 1 to 64",
        "overlap is 'yes'; give true",
        "device_memory_GiB is -40; give device_memory_GiB as a positive number",
        "low <= value <= high must hold",
        "links.inter.alpha_us: missing",
        "links.intr: unknown key; did you mean intra?",
        "device_tflops: missing; the per-op step time needs it beside host_us_per_kernel",
    ):
        assert says in err, (says, err)
    assert not (tmp_path / "rec").exists()  # refused before anything was measured or written


@pytest.mark.parametrize(
    "change, flags, says",
    [
        ({"ranks_per_node": 2.5}, [], "ranks_per_node is 2.5; give a whole number"),
        ({"ranks_per_node": True}, [], "ranks_per_node is True; give a whole number"),
        ({"ranks_per_node": 1000}, [], "ranks_per_node is 1000; give a whole number from 1 to 64"),
        ({"host_us_per_kernel": float("nan")}, [], "host_us_per_kernel is nan"),
        ({"links": {"intra": {"alpha_us": 7, "busbw_GBps": 8}}}, ["--nnodes", "2"], "links.inter: missing"),
        ({"links": "fast"}, [], "links: missing; give links:"),
        ({"device_memory_GiB": None}, [], "device_memory_GiB is None"),
    ],
)
def test_each_kind_of_problem_is_named_with_its_fix(tmp_path, capsys, change, flags, says):
    doc = {**a100(), **change}
    assert main(recommend(write(tmp_path, doc), tmp_path, *flags)) == 2
    assert says in capsys.readouterr().err


def test_a_missing_link_the_layout_needs_is_named_and_the_fix_is_accepted(tmp_path, capsys):
    doc = a100()
    inter = doc["links"].pop("inter")
    assert main(recommend(write(tmp_path, doc), tmp_path, "--nnodes", "2")) == 2
    assert "links.inter: missing; the requested layout uses the link between nodes" in capsys.readouterr().err
    doc["links"]["inter"] = inter  # the fix: give the link
    assert cluster_problems(doc, {"inter", "intra", "device_memory_GiB"}) == []


def test_project_checks_its_cluster_file_the_same_way(tmp_path, capsys):
    doc = {**a100(), "ranks_per_nod": 2}
    assert main(["project", "--profile", "paper", "--cluster", write(tmp_path, doc)]) == 2
    assert "ranks_per_nod: unknown key; did you mean ranks_per_node?" in capsys.readouterr().err
