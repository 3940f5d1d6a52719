"""``kanscale run --launcher slurm --submit`` against a real SLURM cluster.

Drives the ``slurm_cluster`` fixture's real one-machine cluster (munged, slurmctld and two slurmd
node entries kn1/kn2 on 127.0.0.1, each CPUs=2): every test hands a generated sbatch script to the
real sbatch, waits for the job with ``scontrol`` and reads the run records the ranks wrote.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.cluster.cli import SHORT, STRATEGY_FOR, cli_env, explain, job_logs, kanscale, records, submitted_job
from tests.cluster.daemons import which

# Job time limits: ranks import torch (and deepspeed) on 2 shared cores (DeepSpeed builds no C++
# op on CPUs: strategies/backends/deepspeed.py, prepare_import).
JOB_TIMEOUT = {"torchrun": 300, "accelerate": 300, "deepspeed": 480}


def submit(cluster, out, *args, strategy="ddp", inner="torchrun", nnodes=1, nproc=1, cwd=None):
    """``kanscale run quickstart --launcher slurm --submit ...``; the job id sbatch gave."""
    done = kanscale(
        "run",
        "quickstart",
        "--strategy",
        strategy,
        "--launcher",
        "slurm",
        "--inner-launcher",
        inner,
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc),
        "--slurm-device",
        "cpu",
        "--submit",
        "--out",
        str(out),
        *SHORT,
        *args,
        env=cli_env(**cluster.env),
        **({"cwd": cwd} if cwd else {}),
    )
    return submitted_job(done)


@pytest.mark.parametrize("topology", ["1x2", "2x1"])
@pytest.mark.parametrize("inner", ["torchrun", "deepspeed", "accelerate"])
def test_submitted_job_trains_and_writes_an_ok_record(slurm_cluster, tmp_path, inner, topology):
    nnodes, nproc = map(int, topology.split("x"))
    out = tmp_path / "runs"
    job = submit(slurm_cluster, out, strategy=STRATEGY_FOR[inner], inner=inner, nnodes=nnodes, nproc=nproc)
    state = slurm_cluster.wait_job(job, JOB_TIMEOUT[inner])
    found = records(out)
    assert state == "COMPLETED", f"job {job} ended {state}\n{job_logs(out, job)}"
    assert len(found) == 1, f"{len(found)} run records in {out}\n{job_logs(out, job)}"
    (record,) = found
    t = record.topology
    assert record.status == "ok", f"{record.error}\n{job_logs(out, job)}"
    assert (t.world_size, t.nodes, t.procs_per_node) == (nnodes * nproc, nnodes, nproc)
    assert t.launcher == "slurm"
    assert t.device_type == "cpu"
    used = slurm_cluster.job_info(job).get("NodeList", "")
    expected_nodes = {1: ("kn1", "kn2"), 2: ("kn[1-2]",)}[nnodes]
    assert used in expected_nodes, f"job {job} ran on {used!r}"


def test_failing_rank_ends_the_job_with_a_failed_record(slurm_cluster, tmp_path):
    out = tmp_path / "runs"
    job = submit(
        slurm_cluster,
        out,
        "--set",
        "fault.rank=1",
        "--set",
        "fault.step=2",
        "--set",
        "fault.kind=exception",
        nnodes=2,
        nproc=1,
    )
    state = slurm_cluster.wait_job(job, JOB_TIMEOUT["torchrun"])
    assert state == "FAILED", f"job {job} ended {state}\n{job_logs(out, job)}"
    found = records(out)
    assert len(found) == 1, f"{len(found)} run records in {out}\n{job_logs(out, job)}"
    (record,) = found
    assert record.status == "failed", job_logs(out, job)
    assert record.error is not None and record.topology.world_size == 2


def test_relative_out_works_when_the_script_is_submitted_from_another_directory(slurm_cluster, tmp_path):
    """The script is written in one directory with a relative --out and sbatch is run from
    another: SLURM resolves #SBATCH paths against the submitting directory, so they must be absolute."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir(), elsewhere.mkdir()
    done = kanscale(
        "run",
        "quickstart",
        "--strategy",
        "ddp",
        "--launcher",
        "slurm",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--slurm-device",
        "cpu",
        "--out",
        "rel-runs",
        *SHORT,
        cwd=work,
        env=cli_env(**slurm_cluster.env),
    )
    assert done.returncode == 0, explain(done)
    scripts = list((work / "rel-runs").rglob("*.sbatch"))
    assert len(scripts) == 1, f"sbatch scripts under {work / 'rel-runs'}: {scripts}\n{explain(done)}"
    sbatch = subprocess.run(
        [which("sbatch"), str(scripts[0])],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=30,
        env=cli_env(**slurm_cluster.env),
    )
    assert sbatch.returncode == 0, sbatch.stderr
    job = sbatch.stdout.split()[-1]
    state = slurm_cluster.wait_job(job, JOB_TIMEOUT["torchrun"])
    logs = job_logs(tmp_path, job)
    assert state == "COMPLETED", f"job {job} ended {state}\n{logs}"
    found = records(work / "rel-runs")
    assert [r.status for r in found] == ["ok"], logs
    assert found[0].topology.nodes == 2
    assert list(elsewhere.iterdir()) == [], (
        f"the job wrote into the directory sbatch ran in: {list(elsewhere.iterdir())}"
    )
    assert "no output file" not in job_logs(work / "rel-runs", job), "the job's output file is not beside its script"


def test_kanscale_submit_from_another_directory_with_relative_out(slurm_cluster, tmp_path):
    """``kanscale run --submit`` run outside the checkout, with a relative --out: the records land
    under that directory."""
    work = tmp_path / "work"
    work.mkdir()
    job = submit(slurm_cluster, "rel-runs", nnodes=1, nproc=1, cwd=work)
    state = slurm_cluster.wait_job(job, JOB_TIMEOUT["torchrun"])
    assert state == "COMPLETED", f"job {job} ended {state}\n{job_logs(tmp_path, job)}"
    assert [r.status for r in records(work / "rel-runs")] == ["ok"], job_logs(tmp_path, job)


@pytest.mark.parametrize("topology", ["1x2", "2x1"])
def test_a_hung_rank_under_deepspeed_is_recorded_as_hung(slurm_cluster, tmp_path, topology):
    """A rank that stops responding (fault.kind=hang): the other times out (runtime.timeout_s) and
    the launchers end the job; the record names the hung rank, as it does outside SLURM."""
    nnodes, nproc = map(int, topology.split("x"))
    out = tmp_path / "runs"
    job = submit(
        slurm_cluster,
        out,
        "--set",
        "fault.rank=1",
        "--set",
        "fault.step=3",
        "--set",
        "fault.kind=hang",
        "--set",
        "runtime.timeout_s=10",
        strategy="zero2",
        inner="deepspeed",
        nnodes=nnodes,
        nproc=nproc,
    )
    state = slurm_cluster.wait_job(job, JOB_TIMEOUT["deepspeed"])
    assert state == "FAILED", f"job {job} ended {state}\n{job_logs(out, job)}"
    (record,) = records(out)
    assert record.status == "failed" and record.error is not None, job_logs(out, job)
    assert (record.error.type, record.error.rank) == ("RankHung", 1), f"{record.error}\n{job_logs(out, job)}"


def test_hsdp_across_two_nodes_shards_inside_each_node(slurm_cluster, tmp_path):
    """``hsdp`` on 2 SLURM nodes of 2 ranks: 2 replicas x 2 shards, each shard group the
    ranks of one node (0-1 on one, 2-3 on the other, as SLURM placed them), and the counted step's
    gathers and reduce-scatters stayed inside the nodes while only the replicas' all-reduce crossed."""
    out = tmp_path / "runs"
    job = submit(slurm_cluster, out, strategy="hsdp", nnodes=2, nproc=2)
    state = slurm_cluster.wait_job(job, JOB_TIMEOUT["torchrun"])
    found = records(out)
    assert state == "COMPLETED" and len(found) == 1, f"job {job} ended {state}\n{job_logs(out, job)}"
    (record,) = found
    assert record.status == "ok" and record.strategy.label == "hsdp", f"{record.error}\n{job_logs(out, job)}"
    assert record.topology.mesh == {"dp_replicate": 2, "dp_shard": 2, "tp": 1}
    hosts = record.environment.rank_hosts
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3] and set(hosts) == {"kn1", "kn2"}, hosts
    traffic = record.comm_bytes
    assert traffic.intra_node_bytes > traffic.inter_node_bytes > 0
