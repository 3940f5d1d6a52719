"""Fixtures for the tests against real outside components (``make test-cluster``).

The tests here start real daemons (munged, slurmctld, two slurmd, sshd) on 127.0.0.1, or a real
headless Chromium to open the HTML report, and need root and Debian packages, so they run only
with ``KANSCALE_CLUSTER_TESTS=1`` (which ``make test-cluster`` sets); ``make test`` leaves the
folder out. Missing packages are installed
with apt-get (scripts/cluster_packages.sh) when this is root on Debian; otherwise every test that
needs them skips, naming what is missing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cluster.daemons import SLURM_PROGRAMS, SSH_PROGRAMS, ensure_installed, missing
from tests.cluster.slurm_cluster import SlurmCluster
from tests.cluster.sshd import SshServer

HERE = Path(__file__).resolve().parent
ENABLED = os.environ.get("KANSCALE_CLUSTER_TESTS") == "1"
GATE = (
    "tests/cluster starts real SLURM, munge and sshd daemons and a headless Chromium (root, Debian packages): "
    "run them with `make test-cluster`, or set KANSCALE_CLUSTER_TESTS=1"
)


def pytest_collection_modifyitems(config, items):
    if ENABLED:
        return
    skip = pytest.mark.skip(reason=GATE)
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


def need_root(what: str, programs: dict[str, str]) -> None:
    if os.geteuid() != 0:
        absent = missing(programs)
        pytest.skip(
            f"{what} needs root (its daemons run as root and as the munge user); run `make test-cluster` as root"
            + (f"; also missing here: {', '.join(absent)}" if absent else "")
        )


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running two-node SLURM cluster (kn1, kn2 on 127.0.0.1): ``.env`` for clients and jobs,
    ``.nodes``, ``.wait_job(job_id, timeout_s) -> final state``, ``.job_state(job_id)``."""
    need_root("the SLURM cluster", SLURM_PROGRAMS)
    reason = ensure_installed(SLURM_PROGRAMS)
    if reason:
        pytest.skip(f"SLURM cluster: {reason}")
    cluster = SlurmCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@dataclass(frozen=True)
class SshHosts:
    port: int
    key: Path
    ssh_options: list[str]  # everything an ssh client needs: -o ... -i KEY -p PORT
    hosts: tuple[str, ...] = ("localhost", "127.0.0.1")  # two names of this machine, one per "node"


@pytest.fixture(scope="session")
def ssh_hosts():
    """sshd on 127.0.0.1:PORT letting root in with a generated key, and pdsh installed."""
    need_root("sshd for root", SSH_PROGRAMS)
    reason = ensure_installed(SSH_PROGRAMS)
    if reason:
        pytest.skip(f"ssh + pdsh: {reason}")
    server = SshServer()
    try:
        server.start()
        yield SshHosts(port=server.port, key=server.client_key, ssh_options=server.ssh_options)
    finally:
        server.stop()
