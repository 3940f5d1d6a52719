"""A real sshd on 127.0.0.1:PORT with its own sshd_config, host key, client key and
authorized_keys (AuthorizedKeysFile points at the tmp dir; /root/.ssh is not touched).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.cluster.daemons import Daemons, free_port, keep_files, wait_for, which

PRIVSEP_DIR = Path("/run/sshd")  # sshd's privilege separation directory, made if missing


class SshServer:
    """sshd on 127.0.0.1:PORT that lets root in with a generated ed25519 key."""

    def __init__(self) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="kanscale-sshd-"))
        self.base.chmod(0o755)
        self.port = free_port()
        self.host_key = self.base / "ssh_host_ed25519_key"
        self.client_key = self.base / "id_ed25519"
        self.authorized_keys = self.base / "authorized_keys"
        self.config = self.base / "sshd_config"
        self.log = self.base / "sshd.log"
        self.daemons = Daemons()
        self.made_privsep_dir = False

    @property
    def ssh_options(self) -> list[str]:
        """What an ssh client needs to reach this server without prompts."""
        return [
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "BatchMode=yes",
            "-o",
            "LogLevel=ERROR",
            "-i",
            str(self.client_key),
            "-p",
            str(self.port),
        ]

    def start(self) -> SshServer:
        keygen = which("ssh-keygen")
        for key in (self.host_key, self.client_key):
            subprocess.run(
                [keygen, "-q", "-t", "ed25519", "-N", "", "-C", "kanscale-cluster-test", "-f", str(key)],
                check=True,
                capture_output=True,
            )
        shutil.copy(self.client_key.with_suffix(".pub"), self.authorized_keys)
        self.authorized_keys.chmod(0o600)
        # sshd needs its privilege-separation directory (compiled in); removed again at stop if made here
        self.made_privsep_dir = not PRIVSEP_DIR.exists()
        PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
        self.config.write_text(
            "\n".join(
                [
                    f"Port {self.port}",
                    "ListenAddress 127.0.0.1",
                    f"HostKey {self.host_key}",
                    f"PidFile {self.base / 'sshd.pid'}",
                    f"AuthorizedKeysFile {self.authorized_keys}",
                    "PermitRootLogin prohibit-password",
                    "PubkeyAuthentication yes",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    "StrictModes no",
                    "PermitUserEnvironment no",
                    "AcceptEnv *",
                    "MaxStartups 100:30:200",
                    "MaxSessions 100",
                    "X11Forwarding no",
                    "PrintMotd no",
                    "LogLevel INFO",
                    "Subsystem sftp internal-sftp",
                ]
            )
            + "\n"
        )
        sshd = which("sshd")
        subprocess.run([sshd, "-t", "-f", str(self.config)], check=True, capture_output=True)
        self.daemons.start("sshd", [sshd, "-D", "-e", "-f", str(self.config)], self.log)
        wait_for(
            "sshd to let the key in",
            lambda: self.daemons.check_alive() or self.ssh("127.0.0.1", "true").returncode == 0,
            30,
            self.log,
        )
        return self

    def ssh(self, host: str, *command: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(
            [which("ssh"), *self.ssh_options, host, *command], capture_output=True, text=True, timeout=timeout
        )

    def stop(self) -> None:
        try:
            self.daemons.stop()
        finally:
            if self.made_privsep_dir:
                with contextlib.suppress(OSError):
                    PRIVSEP_DIR.rmdir()
            if not keep_files():
                shutil.rmtree(self.base, ignore_errors=True)
