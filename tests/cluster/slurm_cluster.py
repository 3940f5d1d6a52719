"""A real SLURM cluster on one machine: munged (as the munge user, its own socket), slurmctld and
two slurmd node entries (kn1, kn2) on 127.0.0.1, every port free-picked, every file under one
tmp dir. Without slurmdbd a finished job's state comes from ``scontrol show job``
(MinJobAge=3600 keeps it there for an hour) and, after that, from the jobcomp/filetxt log.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.cluster.daemons import (
    Daemons,
    cmdline,
    environ_of,
    free_port,
    keep_files,
    kill_process,
    node_hardware,
    pids_of,
    search_path,
    wait_for,
    which,
)

# JobState values a job does not leave (scontrol's names)
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "SPECIAL_EXIT",
    "REVOKED",
}


class SlurmCluster:
    """A two-node SLURM cluster on this machine (see the module docstring)."""

    nodes = ("kn1", "kn2")
    partition = "kan"

    def __init__(self) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="kanscale-slurm-"))
        self.base.chmod(0o755)  # the munge user must reach its directory below
        self.conf = self.base / "etc" / "slurm.conf"
        self.munge_dir = self.base / "munge"
        self.munge_socket = self.munge_dir / "munge.socket"
        self.log_dir = self.base / "log"
        self.jobcomp = self.log_dir / "jobcomp.txt"
        self.ctld_port = free_port()
        self.node_ports = {name: free_port() for name in self.nodes}
        self.daemons = Daemons()
        self.hardware = node_hardware()

    @property
    def env(self) -> dict[str, str]:
        """What a client (sbatch, squeue, scontrol) and the jobs it submits need in their environment."""
        return {"SLURM_CONF": str(self.conf), "PATH": search_path()}

    # -- setup ----------------------------------------------------------------------------
    def slurm_conf(self) -> str:
        host = socket.gethostname().split(".")[0]
        # Each node entry claims the whole machine (CPUs=2 on a 2-core box): SLURM accepts two nodes
        # sharing the cores; what a job asks for (--cpus-per-task) is still checked per node.
        node = " ".join(f"{k}={v}" for k, v in self.hardware.items()) + " State=UNKNOWN"
        lines = [
            "ClusterName=kanscale",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={self.ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "CommunicationParameters=NoInAddrAny",
            f"StateSaveLocation={self.base / 'state'}",
            f"SlurmdSpoolDir={self.base / 'spool' / '%n'}",
            f"SlurmctldPidFile={self.base / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.base / 'run' / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={self.log_dir / 'slurmctld.log'}",
            f"SlurmdLogFile={self.log_dir / 'slurmd-%n.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={self.jobcomp}",
            "MinJobAge=3600",  # keeps finished jobs in `scontrol show job` (no slurmdbd, no sacct)
            "ReturnToService=2",
            "SlurmdTimeout=300",
            "InactiveLimit=0",
            "KillWait=5",
            "Waittime=0",
            *[
                f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} {node}"
                for name, port in self.node_ports.items()
            ],
            f"PartitionName={self.partition} Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP",
        ]
        return "\n".join(lines) + "\n"

    def start(self) -> SlurmCluster:
        for sub in ("etc", "state", "run", "log", *[f"spool/{n}" for n in self.nodes]):
            (self.base / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(self.slurm_conf())
        self.start_munge()
        env = {**os.environ, **self.env}
        self.daemons.start(
            "slurmctld", [which("slurmctld"), "-D", "-f", str(self.conf)], self.log_dir / "slurmctld.out", env=env
        )
        wait_for(
            "slurmctld to answer",
            lambda: self.daemons.check_alive() or self.scontrol("ping").returncode == 0,
            60,
            self.log_dir / "slurmctld.log",
        )
        for name in self.nodes:
            self.daemons.start(
                f"slurmd {name}",
                [which("slurmd"), "-D", "-f", str(self.conf), "-N", name],
                self.log_dir / f"slurmd-{name}.out",
                env=env,
            )
        wait_for(
            "both nodes to be idle",
            lambda: self.daemons.check_alive() or self.idle_nodes() == set(self.nodes),
            90,
            self.log_dir / "slurmctld.log",
        )
        return self

    def start_munge(self) -> None:
        munge = pwd.getpwnam("munge")
        self.munge_dir.mkdir()
        os.chown(self.munge_dir, munge.pw_uid, munge.pw_gid)
        self.munge_dir.chmod(0o755)  # world-executable: every client reaches the socket
        key = self.munge_dir / "munge.key"
        subprocess.run(
            [which("mungekey"), "--create", f"--keyfile={key}"],
            check=True,
            capture_output=True,
            user=munge.pw_uid,
            group=munge.pw_gid,
            extra_groups=[],
        )
        log = self.munge_dir / "munged.log"
        self.daemons.start(
            "munged",
            [
                which("munged"),
                "--foreground",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--log-file={log}",
                f"--pid-file={self.munge_dir / 'munged.pid'}",
                f"--seed-file={self.munge_dir / 'munged.seed'}",
            ],
            self.base / "log" / "munged.out",
            user=munge.pw_uid,
            group=munge.pw_gid,
            extra_groups=[],
        )
        wait_for("munged's socket", lambda: self.daemons.check_alive() or self.munge_socket.exists(), 30, log)

    # -- clients --------------------------------------------------------------------------
    def client(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(
            list(args), capture_output=True, text=True, timeout=timeout, env={**os.environ, **self.env}
        )

    def scontrol(self, *args: str) -> subprocess.CompletedProcess:
        return self.client(which("scontrol"), *args)

    def idle_nodes(self) -> set[str]:
        done = self.client(which("sinfo"), "-h", "-N", "-o", "%N %t")
        return {line.split()[0] for line in done.stdout.splitlines() if line.split()[1:] == ["idle"]}

    def job_state(self, job_id: str | int) -> str | None:
        """The job's state (``PENDING``, ``RUNNING``, ``COMPLETED``, ``FAILED``...), None if unknown."""
        done = self.scontrol("show", "job", "-o", str(job_id))
        match = re.search(r"\bJobState=(\S+)", done.stdout)
        if match:
            return match.group(1)
        if self.jobcomp.exists():  # after MinJobAge: the completion log
            for line in self.jobcomp.read_text().splitlines():
                if re.search(rf"\bJobId={job_id}\b", line):
                    found = re.search(r"\bJobState=(\S+)", line)
                    return found.group(1) if found else None
        return None

    def job_info(self, job_id: str | int) -> dict[str, str]:
        done = self.scontrol("show", "job", "-o", str(job_id))
        return dict(re.findall(r"(\w+)=(\S*)", done.stdout))

    def wait_job(self, job_id: str | int, timeout_s: float = 300) -> str:
        """Wait until the job has finished; its final state (``COMPLETED``, ``FAILED``, ...)."""
        deadline = time.monotonic() + timeout_s
        state = None
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in FINAL_STATES:
                return state
            time.sleep(1)
        self.client(which("scancel"), str(job_id))
        raise AssertionError(
            f"job {job_id} still {state} after {timeout_s:.0f} s (cancelled)\n"
            f"{self.scontrol('show', 'job', str(job_id)).stdout}"
        )

    def active_jobs(self) -> list[str]:
        done = self.client(which("squeue"), "-h", "-o", "%i %T")
        return done.stdout.split()[::2] if done.returncode == 0 else []

    # -- teardown -------------------------------------------------------------------------
    def stop(self) -> None:
        """Cancel every job, stop every daemon (and any job step left behind), remove the files."""
        try:
            if self.daemons.procs and self.conf.exists():
                self.client(which("scancel"), "--full", f"--partition={self.partition}")
                with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                    wait_for("the jobs to end", lambda: not self.active_jobs(), 30)
        finally:
            self.daemons.stop()
            # slurmstepd daemonizes away from slurmd: end the ones of this cluster (by its config)
            for pid in pids_of("slurmstepd"):
                if environ_of(pid).get("SLURM_CONF") == str(self.conf) or str(self.base) in cmdline(pid):
                    kill_process(pid)
            if not keep_files():
                shutil.rmtree(self.base, ignore_errors=True)
