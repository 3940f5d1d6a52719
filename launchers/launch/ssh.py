"""The deepspeed launcher's ssh path: node 0 starts every node of a hostfile with pdsh over ssh.

What it needs is checked here before launch, because DeepSpeed finds out late and says it badly
(a missing pdsh is a traceback): pdsh and ssh on this machine, and non-interactive ssh to every
host with the port and key the launch will use. The remote ranks see only the variables
DeepSpeed exports; what they need (``DS_ACCELERATOR`` on CPUs, the thread and cache settings
exported here) goes into the env file DeepSpeed reads (``DS_ENV_FILE``, its ``.deepspeed_env``).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

from kanscale.errors import ConfigError
from strategies.backends.deepspeed import accelerator_env

# Variables of this environment the remote ranks get too (DeepSpeed itself forwards PYTHON*,
# UCX*, MLFLOW* and its accelerator's own, e.g. NCCL_*).
FORWARDED_PREFIXES = ("DS_", "TORCH_", "OMP_", "KANSCALE_", "CUDA_VISIBLE_DEVICES")
# characters a double-quoted shell string does not keep literal, and the line break
UNSAFE_IN_EXPORT = frozenset('$`"\\\n')
# the env files DeepSpeed reads when DS_ENV_FILE is not set: the user's, kept in ours
USER_ENV_FILES = (Path.home() / ".deepspeed_env", Path(".deepspeed_env"))


def ssh_command(host: str, port: int | None, key: str | None) -> list[str]:
    """ssh to ``host`` the way pdsh will (``PDSH_SSH_ARGS_APPEND`` included), never asking for a password."""
    return (
        [
            "ssh",
            "-o",
            "BatchMode=yes",
            "-o",
            "ConnectTimeout=10",
            *shlex.split(os.environ.get("PDSH_SSH_ARGS_APPEND", "")),
        ]
        + (["-p", str(port)] if port else [])
        + (["-i", key] if key else [])
        + [host, "true"]
    )


def check_ssh_path(hosts: list[str], port: int | None, key: str | None) -> None:
    """Refuse an ssh launch that cannot start: pdsh or ssh missing, or a host ssh cannot reach."""
    if shutil.which("pdsh") is None:
        raise ConfigError(
            "--launcher deepspeed: the hostfile's nodes are started over ssh with pdsh, which is not "
            "installed here; install it (Debian: apt-get install pdsh), or start each node yourself "
            "with --no-ssh --node-rank R"
        )
    if shutil.which("ssh") is None:
        raise ConfigError(
            "--launcher deepspeed: the hostfile's nodes are started over ssh, which is not installed here; "
            "install an ssh client (Debian: apt-get install openssh-client), or use --no-ssh"
        )
    if key is not None and not Path(key).is_file():
        raise ConfigError(f"--ssh-key: {key} does not exist; give the private key that logs in to every node")
    if key is not None and any(c.isspace() for c in key):
        raise ConfigError(
            f"--ssh-key: {key!r} contains a space, which pdsh would split; move or link the key to a "
            "path without spaces"
        )
    for host in hosts:
        done = subprocess.run(ssh_command(host, port, key), capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            reason = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit code {done.returncode}"
            raise ConfigError(
                f"--hostfile: ssh cannot reach {host} without a password ({reason}); set up key-based ssh "
                "to every node (--ssh-key, --ssh-port, or ~/.ssh/config), or start each node yourself with "
                "--no-ssh --node-rank R"
            )


def deepspeed_env_text(device_type: str) -> str:
    """The env file every remote rank exports: the user's own ``.deepspeed_env`` lines, then what
    this environment sets that the ranks need, then the accelerator choice."""
    lines = [
        line.strip()
        for path in USER_ENV_FILES
        if path.is_file()
        for line in path.read_text().splitlines()
        if "=" in line
    ]
    variables = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_PREFIXES)} | accelerator_env(device_type)
    for key, value in sorted(variables.items()):
        # DeepSpeed writes each as `export KEY="VALUE";` into the remote shell's command line, so
        # what a double-quoted string still expands (or a line break) would run there
        unsafe = sorted({c for c in value if c in UNSAFE_IN_EXPORT})
        if unsafe:
            raise ConfigError(
                f"{key}: its value holds {' '.join(repr(c) for c in unsafe)}, which the remote shell would "
                "act on when DeepSpeed exports it to the other nodes; unset it or remove those characters"
            )
        lines.append(f"{key}={value}")
    return "".join(f"{line}\n" for line in lines)
