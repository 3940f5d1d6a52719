"""The DeepSpeed multi-node ssh path against a real sshd and pdsh.

Drives the ``ssh_hosts`` fixture's real sshd on 127.0.0.1:PORT (its own config, a generated host
key and ed25519 client key) through the real pdsh (``pdsh -R ssh``, as DeepSpeed's PDSH runner
starts it): a hostfile of two entries for this machine, ``localhost`` and ``127.0.0.1``, trains two
ranks as two nodes; without pdsh on PATH the launch is refused before anything starts.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.cluster.cli import SHORT, cli_env, explain, kanscale, records
from tests.cluster.daemons import search_path, which

# What a user puts in the environment so that pdsh's ssh does not stop at unknown host keys.
SSH_APPEND = "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null"


def hostfile(tmp_path: Path, hosts) -> Path:
    path = tmp_path / "hostfile"
    path.write_text("".join(f"{host} slots=1\n" for host in hosts))
    return path


def test_pdsh_reaches_both_host_entries_through_the_test_sshd(ssh_hosts):
    """The setup itself: pdsh with DeepSpeed's options and PDSH_SSH_ARGS_APPEND carrying port and key."""
    env = dict(os.environ, PDSH_RCMD_TYPE="ssh", PDSH_SSH_ARGS_APPEND=" ".join(ssh_hosts.ssh_options))
    done = subprocess.run(
        [which("pdsh"), "-S", "-f", "1024", "-w", ",".join(ssh_hosts.hosts), "hostname"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(line.split(":")[0] for line in done.stdout.splitlines()) == sorted(ssh_hosts.hosts)


def deepspeed_ssh_run(ssh_hosts, tmp_path, env, hosts=None):
    """``kanscale run`` over the test sshd, on its host entries or on ``hosts``."""
    return kanscale(
        "run",
        "quickstart",
        "--strategy",
        "zero2",
        "--launcher",
        "deepspeed",
        "--hostfile",
        str(hostfile(tmp_path, hosts or ssh_hosts.hosts)),
        "--ssh-port",
        str(ssh_hosts.port),
        "--ssh-key",
        str(ssh_hosts.key),
        "--nproc-per-node",
        "1",
        "--out",
        str(tmp_path / "runs"),
        *SHORT,
        env=env,
        timeout=480,
    )


def test_an_unreachable_host_is_named_before_launch(ssh_hosts, tmp_path):
    """The first entry answers (the test sshd, its key); the second is named, and nothing starts."""
    env = cli_env(PDSH_SSH_ARGS_APPEND=SSH_APPEND)
    done = deepspeed_ssh_run(ssh_hosts, tmp_path, env, hosts=["127.0.0.1", "no-such-node.invalid"])
    assert done.returncode == 2, explain(done)
    assert "ssh cannot reach no-such-node.invalid without a password" in done.stderr, explain(done)
    assert "cannot reach 127.0.0.1" not in done.stderr, explain(done)
    assert "Traceback" not in done.stderr and not (tmp_path / "runs").exists(), explain(done)


def test_deepspeed_over_ssh_trains_two_ranks_on_two_host_entries(ssh_hosts, tmp_path):
    done = deepspeed_ssh_run(ssh_hosts, tmp_path, cli_env(PDSH_SSH_ARGS_APPEND=SSH_APPEND))
    assert done.returncode == 0, explain(done)
    found = records(tmp_path / "runs")
    assert len(found) == 1, f"{len(found)} run records\n{explain(done)}"
    (record,) = found
    t = record.topology
    assert record.status == "ok", record.error
    assert (t.world_size, t.nodes, t.procs_per_node, t.launcher) == (2, 2, 1, "deepspeed")
    assert t.device_type == "cpu"


def path_without(program: str, farm: Path) -> str:
    """A PATH with every program of this one but ``program``: links in ``farm``."""
    farm.mkdir()
    for directory in search_path().split(":"):
        if not directory or not Path(directory).is_dir():
            continue
        for entry in Path(directory).iterdir():
            link = farm / entry.name
            if entry.name != program and not link.exists() and not link.is_symlink():
                link.symlink_to(entry)
    return str(farm)


def test_missing_pdsh_is_refused_before_launch(ssh_hosts, tmp_path):
    env = cli_env(PDSH_SSH_ARGS_APPEND=SSH_APPEND, PATH=path_without("pdsh", tmp_path / "bin"))
    assert subprocess.run(["sh", "-c", "command -v pdsh"], env=env, capture_output=True).returncode != 0
    done = deepspeed_ssh_run(ssh_hosts, tmp_path, env)
    assert done.returncode == 2, explain(done)
    assert "pdsh" in done.stderr, explain(done)
    assert "Traceback" not in done.stderr, explain(done)
    assert not records(tmp_path / "runs"), "a run started although pdsh is missing"
