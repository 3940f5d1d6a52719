"""``kanscale sweep --submit`` against a real SLURM cluster.

Drives the ``slurm_cluster`` fixture's real one-machine cluster (munged, slurmctld, slurmd kn1/kn2
on 127.0.0.1): a tiny study whose launcher is slurm is submitted point by point with the real
sbatch, followed to the end (``--wait``), and its sweep log must end with each point's final
status. A study whose launcher is not slurm is refused with ``--submit`` before anything runs.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.cluster.cli import cli_env, explain, kanscale, records
from tests.cluster.daemons import ROOT

QUICKSTART = ROOT / "configs" / "experiments" / "quickstart.yaml"


def write_study(path: Path, launcher: str, topologies: list[str]) -> Path:
    path.write_text(
        "\n".join(
            [
                "study: clustertiny",
                "preset: cpu",
                "description: two points of the quickstart, a few steps each",
                f"experiment: {QUICKSTART}",
                f"launcher: {launcher}",
                "set:",
                "  training.steps: 10",
                "  training.micro_batch: 64",
                "  measurement.baseline_steps: 2",
                "matrix:",
                "  strategy: [ddp]",
                f"  topology: [{', '.join(topologies)}]",
            ]
        )
        + "\n"
    )
    return path


def final_statuses(out: Path) -> dict[str, str]:
    """Each point's last status in OUT/sweep.jsonl."""
    statuses = {}
    for line in (out / "sweep.jsonl").read_text().splitlines():
        entry = json.loads(line)
        statuses[entry["point"]] = entry["status"]
    return statuses


def test_submitted_sweep_ends_with_each_points_final_status(slurm_cluster, tmp_path):
    study = write_study(tmp_path / "study.yaml", "slurm", ["1x1", "2x1"])
    out = tmp_path / "sweep"
    done = kanscale(
        "sweep", str(study), "--out", str(out), "--submit", "--wait", env=cli_env(**slurm_cluster.env), timeout=600
    )
    assert done.returncode == 0, explain(done)
    assert (out / "sweep.jsonl").exists(), explain(done)
    statuses = final_statuses(out)
    assert len(statuses) == 2 and set(statuses.values()) == {"ok"}, (out / "sweep.jsonl").read_text() + explain(done)
    found = records(out)
    assert sorted((r.status, r.topology.nodes, r.topology.world_size) for r in found) == [("ok", 1, 1), ("ok", 2, 2)]
    assert not slurm_cluster.active_jobs(), "--wait returned while jobs were still queued or running"


def test_submit_refuses_a_study_whose_launcher_is_not_slurm(slurm_cluster, tmp_path):
    study = write_study(tmp_path / "study.yaml", "torchrun", ["1x1"])
    out = tmp_path / "sweep"
    done = kanscale("sweep", str(study), "--out", str(out), "--submit", env=cli_env(**slurm_cluster.env), timeout=300)
    assert done.returncode == 2, explain(done)
    assert "slurm" in done.stderr.lower(), explain(done)
    assert "Traceback" not in done.stderr, explain(done)
    assert not records(out) and not (out / "logs").exists(), "the sweep ran something before refusing --submit"
    assert not slurm_cluster.active_jobs()


def test_resume_follows_the_jobs_of_an_earlier_submission_without_resubmitting(slurm_cluster, tmp_path):
    """Submit without waiting, then ``--resume --submit --wait``: the points whose jobs still live
    are followed, not submitted again, and the log ends with their final statuses."""
    study = write_study(tmp_path / "study.yaml", "slurm", ["2x1", "1x1"])
    out = tmp_path / "sweep"
    env = cli_env(**slurm_cluster.env)
    first = kanscale("sweep", str(study), "--out", str(out), "--submit", env=env, timeout=300)
    assert first.returncode == 0, explain(first)
    submitted = {e["point"]: e["job_id"] for e in map(json.loads, (out / "sweep.jsonl").read_text().splitlines())}
    assert len(submitted) == 2 and all(submitted.values()), (out / "sweep.jsonl").read_text()
    assert slurm_cluster.active_jobs(), "both jobs ended before the resume could follow one; the test proves nothing"
    second = kanscale("sweep", str(study), "--out", str(out), "--resume", "--submit", "--wait", env=env, timeout=600)
    assert second.returncode == 0, explain(second)
    assert "still lives; not submitted again" in second.stderr, explain(second)
    assert set(final_statuses(out).values()) == {"ok"}, (out / "sweep.jsonl").read_text()
    found = records(out)
    assert len(found) == 2 and {r.environment.slurm_job_id for r in found} == set(submitted.values())
