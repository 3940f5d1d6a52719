"""How each launcher starts the ranks: one small function per launcher, each turning a
:class:`LaunchSpec` and the worker's arguments into the exact commands to run.

Every rank runs the same worker, ``python -m launchers.cli train CONFIG ...``; the launchers
differ only in how they start it and what they tell it through the environment.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from strategies.deepspeed import accelerator_env

LauncherName = Literal["none", "torchrun", "accelerate", "deepspeed", "slurm"]
WORKER_MODULE = "launchers.cli"


@dataclass(frozen=True)
class LaunchSpec:
    """Where the ranks go: nodes x processes per node, and how the nodes find each other."""

    launcher: LauncherName = "torchrun"
    nproc_per_node: int = 1
    nnodes: int = 1
    # an int, or a shell expression (e.g. "$SLURM_NODEID") when the command goes into a script
    node_rank: int | str = 0
    master_addr: str = "127.0.0.1"
    # None until resolved (launchers.ports); a shell expression ("$MASTER_PORT") in a script
    master_port: int | str | None = None
    rdzv_id: str = "kanscale"
    hostfile: str | None = None
    no_ssh: bool = False
    ssh_port: int | None = None  # deepspeed over ssh (pdsh): the nodes' sshd port
    ssh_key: str | None = None  # deepspeed over ssh: the identity file
    deepspeed_env_file: str | None = None  # deepspeed over ssh: what every remote rank exports
    accelerate_config: str | None = None
    device: Literal["cpu", "cuda"] = "cpu"

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


@dataclass
class Launch:
    """Commands to run (together, one per node started from here), the environment they need,
    and files to write first."""

    commands: list[list[str]]
    env: dict[str, str] = field(default_factory=dict)
    files: dict[Path, str] = field(default_factory=dict)

    def render(self) -> str:
        lines = [f"# write {path}:\n" + "".join(f"#   {line}\n" for line in text.splitlines()) for path, text in self.files.items()]
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        lines += [(env + " " if env else "") + shell_join(cmd) for cmd in self.commands]
        return "\n".join(lines)


def shell_join(cmd: list[str]) -> str:
    """Quote a command for a shell, leaving ``$VARIABLES`` (used in generated scripts) to expand."""
    return " ".join('"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"' if "$" in arg else shlex.quote(arg)
                    for arg in cmd)


def python() -> list[str]:
    return [sys.executable]


def worker(args: list[str]) -> list[str]:
    """The module and arguments every rank of a training run runs: ``kanscale train ARGS``."""
    return ["-m", WORKER_MODULE, "train", *args]


def none_launch(spec: LaunchSpec, train_args: list[str]) -> Launch:
    return Launch([python() + worker(train_args)])


def torchrun_launch(spec: LaunchSpec, train_args: list[str], entry: list[str] | None = None) -> Launch:
    """torchrun: ``--standalone`` on one node; c10d rendezvous across nodes. The node that hosts
    the rendezvous store is named explicitly (``is_host``): with every node on one address (two
    agents on one machine), torchrun cannot tell which should host it and both may wait.
    ``entry`` is what every rank runs (``-m MODULE ARGS...``); by default ``kanscale train``."""
    cmd = python() + ["-m", "torch.distributed.run", f"--nproc_per_node={spec.nproc_per_node}"]
    if spec.nnodes == 1:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={spec.nnodes}", f"--node_rank={spec.node_rank}", "--rdzv_backend=c10d",
                f"--rdzv_endpoint={spec.master_addr}:{spec.master_port}", f"--rdzv_id={spec.rdzv_id}"]
        if isinstance(spec.node_rank, int):  # nodes with distinct addresses (SLURM) sort this out themselves
            cmd.append(f"--rdzv_conf=is_host={int(spec.node_rank == 0)}")
    return Launch([cmd + (entry or worker(train_args))])


def accelerate_launch(spec: LaunchSpec, train_args: list[str]) -> Launch:
    """accelerate launch with the strategy's accelerate config, sizes filled in."""
    cmd = python() + ["-m", "accelerate.commands.launch", "--config_file", spec.accelerate_config,
                      f"--num_processes={spec.world_size}", f"--num_machines={spec.nnodes}",
                      f"--machine_rank={spec.node_rank}", f"--main_process_ip={spec.master_addr}",
                      f"--main_process_port={spec.master_port}"]
    return Launch([cmd + worker(train_args)])


def deepspeed_launch(spec: LaunchSpec, train_args: list[str]) -> Launch:
    """The deepspeed launcher: ``--num_gpus`` on one node; a hostfile across nodes, with
    ``--no_ssh --node_rank`` where nodes are started one by one, else over ssh with pdsh.
    Over ssh the remote ranks see only what DeepSpeed exports: its own prefixes and the
    variables of an env file (``DS_ENV_FILE``). Its ssh check is skipped because kanscale run
    made the same check, with the key, before launch (launchers.ssh)."""
    cmd = python() + ["-m", "deepspeed.launcher.runner"]
    env = accelerator_env(spec.device)
    if spec.hostfile is None:
        cmd += [f"--num_gpus={spec.nproc_per_node}", f"--master_port={spec.master_port}"]
    else:
        cmd += [f"--hostfile={spec.hostfile}", f"--master_addr={spec.master_addr}", f"--master_port={spec.master_port}"]
        if spec.no_ssh:
            cmd += ["--no_ssh", f"--node_rank={spec.node_rank}"]
        else:
            cmd += ["--no_ssh_check"] + ([f"--ssh_port={spec.ssh_port}"] if spec.ssh_port else [])
            if spec.ssh_key:  # pdsh splits these on spaces and hands them to ssh; DeepSpeed appends -p PORT itself
                env["PDSH_SSH_ARGS_APPEND"] = f"{os.environ.get('PDSH_SSH_ARGS_APPEND', '')} -i {spec.ssh_key}".strip()
            if spec.deepspeed_env_file:
                env["DS_ENV_FILE"] = spec.deepspeed_env_file
    return Launch([cmd + ["--module", WORKER_MODULE, "train", *train_args]], env=env)


LAUNCHERS = {
    "none": none_launch,
    "torchrun": torchrun_launch,
    "accelerate": accelerate_launch,
    "deepspeed": deepspeed_launch,
}
