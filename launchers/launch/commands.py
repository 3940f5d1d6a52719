"""How each launcher starts the ranks: one small function per launcher, each turning a
:class:`LaunchSpec` and the worker's arguments into the exact commands to run.

Every rank runs the same worker, ``python -m launchers.cli train CONFIG ...``; the launchers
differ only in how they start it and what they tell it through the environment.

A command is an argument list, run without a shell. Where one is written as shell text (the
``--dry-run`` output, an sbatch script) every argument is quoted with ``shlex.quote``; the one
thing left for a shell to expand is a :class:`ScriptVar`, a generated script's own variable.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from kanscale.errors import ConfigError
from strategies.backends.deepspeed import accelerator_env

LauncherName = Literal["none", "torchrun", "accelerate", "deepspeed", "slurm"]
Device = Literal["cpu", "cuda"]


def launcher_name(text: str) -> LauncherName:
    """``text`` (a flag's, a study's or a strategy's choice) as a launcher the suite knows."""
    for name in get_args(LauncherName):
        if name == text:
            return name
    raise ConfigError(f"launcher {text!r}: the launchers are {', '.join(get_args(LauncherName))}")


WORKER_MODULE = "launchers.cli"


class ScriptVar(str):
    """A generated script's own variable (``$SLURM_NODEID``) standing in for a LaunchSpec value
    that each node's shell fills in. A type of its own, so that no user value, whatever text it
    holds, is ever taken for one and left unquoted."""

    def __new__(cls, name: str) -> ScriptVar:
        if not name.isidentifier():
            raise ValueError(f"not a shell variable name: {name!r}")
        return super().__new__(cls, "$" + name)

    @property
    def shell(self) -> str:
        return f'"{self}"'  # double quotes: expanded, never split or globbed


class ShellWord(str):
    """One argument already written as shell text (see :func:`word`), put into a script as it is."""


def word(*parts: object) -> str:
    """One argument made of literal parts and script variables (``--node_rank=$SLURM_NODEID``):
    plain text where no part is a :class:`ScriptVar`; otherwise shell text, in double quotes, in
    which only the variables expand (the literal parts' ``$ ` " \\`` are escaped)."""
    if not any(isinstance(part, ScriptVar) for part in parts):
        return "".join(str(part) for part in parts)
    text = ""
    for part, after in zip(parts, [*parts[1:], ""], strict=True):
        if isinstance(part, ScriptVar):  # braces where a name character follows: $MASTER_PORT0 is another variable
            text += f"${{{part[1:]}}}" if re.match(r"\w", str(after)) else part
        else:
            text += re.sub(r'([$`"\\])', r"\\\1", str(part))
    return ShellWord(f'"{text}"')


@dataclass(frozen=True)
class LaunchSpec:
    """Where the ranks go: nodes x processes per node, and how the nodes find each other."""

    launcher: LauncherName = "torchrun"
    nproc_per_node: int = 1
    nnodes: int = 1
    # an int, or a ScriptVar ($SLURM_NODEID) when the command goes into a script
    node_rank: int | str = 0
    master_addr: str = "127.0.0.1"
    # None until resolved (launchers.launch.ports); a ScriptVar ($MASTER_PORT) in a script
    master_port: int | str | None = None
    rdzv_id: str = "kanscale"
    hostfile: str | None = None
    no_ssh: bool = False
    ssh_port: int | None = None  # deepspeed over ssh (pdsh): the nodes' sshd port
    ssh_key: str | None = None  # deepspeed over ssh: the identity file
    deepspeed_env_file: str | None = None  # deepspeed over ssh: what every remote rank exports
    accelerate_config: str | None = None
    device: Device = "cpu"

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
        """The files and commands as shell text that runs exactly these commands when pasted:
        the files as comment lines (a line break in a path is shown, not written), the
        commands quoted."""
        lines = [
            f"# write {comment(shlex.quote(str(path)))}:\n" + "".join(f"#   {line}\n" for line in text.splitlines())
            for path, text in self.files.items()
        ]
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        lines += [(env + " " if env else "") + shell_join(cmd) for cmd in self.commands]
        return "\n".join(lines)


def comment(text: str) -> str:
    """``text`` fit for one comment line: a line break would end the comment and run the rest."""
    return text.replace("\r", "\\r").replace("\n", "\\n")


def shell_join(cmd: list[str]) -> str:
    """A command as shell text: every argument quoted, except the script variables of
    :func:`word` and :class:`ScriptVar`, which expand (each as one argument)."""
    return " ".join(
        arg if isinstance(arg, ShellWord) else arg.shell if isinstance(arg, ScriptVar) else shlex.quote(arg)
        for arg in cmd
    )


# What a POSIX shell takes literally in an unquoted word (shlex.quote's own test, with [] added:
# a glob that matches no file is left as it is), and what it still acts on inside double quotes.
LITERAL_CHAR = re.compile(r"[\w@%+=:,./\[\]-]", re.ASCII)
ACTIVE_IN_DOUBLE_QUOTES = "$`\\"


def check_pdsh_words(unquoted: list[str], user_args: list[str]) -> None:
    """Refuse what the nodes' shells would run or change on DeepSpeed's ssh path. Its pdsh
    runner hands each node's shell one line of text: the working directory and master address
    as they are, the worker's arguments in double quotes where they hold a space and as they
    are otherwise (DeepSpeed's PDSHRunner), so none of them can be quoted from here."""
    for text, quoted in [(t, False) for t in unquoted] + [(a, " " in a) for a in user_args]:
        bad = sorted({c for c in text if not shell_inert(c, quoted)})
        if bad:
            raise ConfigError(
                f"--launcher deepspeed over ssh: {text!r} would reach each node's shell unquoted (DeepSpeed's "
                f"pdsh launcher passes the worker's arguments and working directory as shell text); remove "
                f"{' '.join(repr(c) for c in bad)} from it, or start each node yourself with --no-ssh "
                "--node-rank R, which passes every argument as it is"
            )


def shell_inert(char: str, double_quoted: bool) -> bool:
    """Whether a shell takes ``char`` as itself, inside double quotes or in a bare word."""
    if not char.isprintable():
        return False
    if double_quoted:
        return char not in ACTIVE_IN_DOUBLE_QUOTES
    return bool(LITERAL_CHAR.fullmatch(char)) or not char.isascii()


def python() -> list[str]:
    return [sys.executable]


def worker(args: list[str]) -> list[str]:
    """The module and arguments every rank of a training run runs: ``kanscale train ARGS``."""
    return ["-m", WORKER_MODULE, "train", *args]


def none_launch(spec: LaunchSpec, train_args: list[str]) -> Launch:
    return Launch([[*python(), *worker(train_args)]])


def torchrun_launch(spec: LaunchSpec, train_args: list[str], entry: list[str] | None = None) -> Launch:
    """torchrun: ``--standalone`` on one node; c10d rendezvous across nodes. The node that hosts
    the rendezvous store is named explicitly (``is_host``): with every node on one address (two
    agents on one machine), torchrun cannot tell which should host it and both may wait.
    ``entry`` is what every rank runs (``-m MODULE ARGS...``); by default ``kanscale train``."""
    cmd = [*python(), "-m", "torch.distributed.run", f"--nproc_per_node={spec.nproc_per_node}"]
    if spec.nnodes == 1:
        cmd.append("--standalone")
    else:
        cmd += [
            f"--nnodes={spec.nnodes}",
            word("--node_rank=", spec.node_rank),
            "--rdzv_backend=c10d",
            word("--rdzv_endpoint=", spec.master_addr, ":", spec.master_port),
            word("--rdzv_id=", spec.rdzv_id),
        ]
        if isinstance(spec.node_rank, int):  # nodes with distinct addresses (SLURM) sort this out themselves
            cmd.append(f"--rdzv_conf=is_host={int(spec.node_rank == 0)}")
    return Launch([cmd + (entry or worker(train_args))])


def accelerate_launch(spec: LaunchSpec, train_args: list[str]) -> Launch:
    """accelerate launch with the strategy's accelerate config, sizes filled in."""
    if spec.accelerate_config is None:
        raise ValueError("an accelerate launch needs its config file: resolve() picks it")
    cmd = [
        *python(),
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        spec.accelerate_config,
        f"--num_processes={spec.world_size}",
        f"--num_machines={spec.nnodes}",
        word("--machine_rank=", spec.node_rank),
        word("--main_process_ip=", spec.master_addr),
        word("--main_process_port=", spec.master_port),
    ]
    return Launch([cmd + worker(train_args)])


def deepspeed_launch(spec: LaunchSpec, train_args: list[str]) -> Launch:
    """The deepspeed launcher: ``--num_gpus`` on one node; a hostfile across nodes, with
    ``--no_ssh --node_rank`` where nodes are started one by one, else over ssh with pdsh.
    Over ssh the remote ranks see only what DeepSpeed exports: its own prefixes and the
    variables of an env file (``DS_ENV_FILE``). Its ssh check is skipped because kanscale run
    made the same check, with the key, before launch (launchers.launch.ssh)."""
    cmd = [*python(), "-m", "deepspeed.launcher.runner"]
    env = accelerator_env(spec.device)
    if spec.hostfile is None:
        cmd += [f"--num_gpus={spec.nproc_per_node}", word("--master_port=", spec.master_port)]
    else:
        cmd += [
            word("--hostfile=", spec.hostfile),
            word("--master_addr=", spec.master_addr),
            word("--master_port=", spec.master_port),
        ]
        if spec.no_ssh:
            cmd += ["--no_ssh", word("--node_rank=", spec.node_rank)]
        else:
            check_pdsh_words([os.getcwd(), spec.master_addr], train_args)
            cmd += ["--no_ssh_check", *([f"--ssh_port={spec.ssh_port}"] if spec.ssh_port else [])]
            if spec.ssh_key:  # pdsh splits these on spaces and hands them to ssh; DeepSpeed appends -p PORT itself
                env["PDSH_SSH_ARGS_APPEND"] = f"{os.environ.get('PDSH_SSH_ARGS_APPEND', '')} -i {spec.ssh_key}".strip()
            if spec.deepspeed_env_file:
                env["DS_ENV_FILE"] = spec.deepspeed_env_file
    return Launch([[*cmd, "--module", WORKER_MODULE, "train", *train_args]], env=env)


LAUNCHERS = {
    "none": none_launch,
    "torchrun": torchrun_launch,
    "accelerate": accelerate_launch,
    "deepspeed": deepspeed_launch,
}
