"""Starting and stopping real daemons from the cluster tests: which programs they need (and the
Debian packages that ship them), free ports, waiting for readiness, and a teardown that signals
exactly the processes a test started (and what they left behind), nothing else on the machine.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_SCRIPT = ROOT / "scripts" / "cluster_packages.sh"
SBIN = "/usr/sbin:/sbin"

# program -> the Debian package that ships it
SLURM_PROGRAMS = {
    "munged": "munge",
    "mungekey": "munge",
    "slurmctld": "slurm-wlm",
    "slurmd": "slurm-wlm",
    "sbatch": "slurm-wlm",
    "scontrol": "slurm-wlm",
    "squeue": "slurm-wlm",
    "srun": "slurm-wlm",
    "scancel": "slurm-wlm",
    "sinfo": "slurm-wlm",
}
SSH_PROGRAMS = {"sshd": "openssh-server", "ssh": "openssh-client", "ssh-keygen": "openssh-client", "pdsh": "pdsh"}


def search_path() -> str:
    return f"{os.environ.get('PATH', '')}:{SBIN}"


def which(program: str) -> str | None:
    return shutil.which(program, path=search_path())


def missing(programs: dict[str, str]) -> list[str]:
    """``program (package)`` for each program not installed."""
    return [f"{p} ({pkg})" for p, pkg in programs.items() if which(p) is None]


_install_note: str | None = None


def ensure_installed(programs: dict[str, str]) -> str | None:
    """None when every program is there (installing with scripts/cluster_packages.sh when root with
    apt-get); otherwise why the tests that need them must skip."""
    global _install_note
    absent = missing(programs)
    if absent and _install_note is None:
        if os.geteuid() != 0:
            _install_note = "not root, so they cannot be installed here"
        elif which("apt-get") is None:
            _install_note = "no apt-get on this machine to install them"
        else:
            done = subprocess.run(["bash", str(PACKAGE_SCRIPT)], capture_output=True, text=True, timeout=900)
            _install_note = (done.stdout + done.stderr).strip() or "scripts/cluster_packages.sh said nothing"
        absent = missing(programs)
    if not absent:
        return None
    return f"missing {', '.join(absent)}: {_install_note}; run `make test-cluster` as root on Debian to install them"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, check, timeout_s: float, log: Path | None = None, interval: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(interval)
    tail = f"\n--- {log}\n{log.read_text()[-3000:]}" if log is not None and log.exists() else ""
    raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}{tail}")


@dataclass
class Daemons:
    """Foreground daemons this test session started, stopped in reverse order."""

    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)

    def start(self, name: str, cmd: list[str], log: Path, **kwargs) -> subprocess.Popen:
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, **kwargs
            )
        self.procs.append((name, proc))
        return proc

    def check_alive(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} (pid {proc.pid}) exited with {proc.returncode}")

    def stop(self) -> None:
        """SIGTERM each daemon (SIGKILL after 15 s), then end what they had started and left behind
        (sshd's per-connection children, ...)."""
        children = descendants({proc.pid for _, proc in self.procs if proc.poll() is None})
        for _name, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _name, proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for pid, started in children.items():
            if _start_time(pid) == started:  # the same process, not a reused pid
                kill_process(pid)
        self.procs.clear()


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()  # the fields after "pid (comm)"


def _start_time(pid: int) -> str | None:
    fields = _stat(pid)
    return fields[19] if fields else None


def descendants(roots: set[int]) -> dict[int, str]:
    """Every live descendant of ``roots``: pid -> start time (to tell a reused pid apart)."""
    parent = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))):
            parent[int(entry.name)] = (int(fields[1]), fields[19])
    found: dict[int, str] = {}
    frontier = set(roots)
    while frontier:
        frontier = {pid for pid, (ppid, _) in parent.items() if ppid in frontier and pid not in found}
        found.update({pid: parent[pid][1] for pid in frontier})
    return found


def pids_of(program: str) -> set[int]:
    """Pids of processes running ``program`` (by executable name)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == program:
                    found.add(int(entry.name))
            except OSError:
                pass
    return found


def environ_of(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def node_hardware() -> dict[str, str]:
    """This machine's CPU layout as slurmd sees it (``slurmd -C``), so that both node entries
    match what their slurmd reports."""
    layout = {
        "CPUs": str(os.cpu_count() or 1),
        "Boards": "1",
        "SocketsPerBoard": "1",
        "CoresPerSocket": str(os.cpu_count() or 1),
        "ThreadsPerCore": "1",
    }
    try:
        done = subprocess.run([which("slurmd"), "-C"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired, TypeError):
        return layout
    found = dict(re.findall(r"(\w+)=(\S+)", done.stdout.splitlines()[0] if done.stdout else ""))
    return {key: found.get(key, value) for key, value in layout.items()}


def keep_files() -> bool:
    """KANSCALE_CLUSTER_KEEP=1 keeps the daemons' configs and logs (tmp dirs) for a look after the run."""
    return os.environ.get("KANSCALE_CLUSTER_KEEP") == "1"


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def kill_process(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
