"""SLURM: an sbatch script that starts one launcher per node with ``srun``.

The head node is the first of the job's node list, reached at the address SLURM itself reaches
it at (a node name need not resolve as a host name); ``srun --kill-on-bad-exit=1`` ends the whole
job when any node's launcher fails, so no node is left waiting for a dead peer. Inside, the
chosen launcher (torchrun, deepspeed or accelerate) starts the node's ranks. The script asks for
what the ranks use: GPUs only where they run on GPUs, and a core per rank and thread.

No value from the user is left for a shell to read: the commands are quoted (launchers.launch.commands,
where the script's own variables are the one thing that expands), and the #SBATCH values are
quoted the way sbatch reads its directives, with a line break (which would end the directive,
and have bash run the rest as a command) refused.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from kanscale.errors import ConfigError
from kanscale.writes import atomic_write_text
from launchers.launch.commands import LAUNCHERS, Device, Launch, LaunchSpec, ScriptVar, shell_join

# The script's own variables, which each node's shell fills in.
HEAD, NODE_RANK, JOB_ID, PORT, HOSTFILE = (
    ScriptVar(name) for name in ("head_addr", "SLURM_NODEID", "SLURM_JOB_ID", "MASTER_PORT", "hostfile")
)
# Without --master-port: the cluster's MASTER_PORT (sbatch passes the submitting environment on),
# else one derived from the job id, so that two jobs sharing a node do not collide.
JOB_PORT = "${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"
# What sbatch reads in a directive as itself, unquoted: anything else goes in double quotes.
SBATCH_PLAIN = re.compile(r"[\w@%+=:,./-]+", re.ASCII)
OUT_FIELD = "--out (the job's output directory)"
JOB_NAME_FIELD = "the SLURM job name (kanscale-<experiment name>-<strategy>, or a study's kanscale-<study>-<point>)"


class SlurmOptions(BaseModel):
    """How a SLURM job is asked for: a study's ``slurm:`` section, or ``kanscale run``'s slurm flags."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    inner: Literal["torchrun", "deepspeed", "accelerate"] = "torchrun"
    device: Literal["auto", "cpu", "cuda"] = "auto"  # what the nodes run on; auto: ask the cluster (sinfo)
    time: str | None = None
    partition: str | None = None
    account: str | None = None


def cluster_device(options: SlurmOptions) -> Device:
    """``cpu`` or ``cuda``: the option, or with ``auto`` whether the (partition's) nodes offer GPUs."""
    if options.device == "cpu" or options.device == "cuda":
        return options.device
    fix = "pass --slurm-device cuda or cpu (a study: slurm.device)"
    if shutil.which("sinfo") is None:
        raise ConfigError(
            f"--slurm-device: auto asks the cluster whether its nodes have GPUs, but sinfo is not on this "
            f"machine; {fix}"
        )
    command = ["sinfo", "--noheader", "--format=%G"] + (
        [f"--partition={options.partition}"] if options.partition else []
    )
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if done.returncode != 0 or not done.stdout.strip():
        reason = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no nodes listed"
        raise ConfigError(
            f"--slurm-device: auto asks the cluster whether its nodes have GPUs, but sinfo failed ({reason}); {fix}"
        )
    return "cuda" if "gpu" in done.stdout else "cpu"  # %G lists generic resources, e.g. gpu:h100:8 or (null)


def sbatch_script(
    spec: LaunchSpec, options: SlurmOptions, train_args: list[str], job_name: str, log_dir: str, cpus_per_task: int = 1
) -> str:
    """The sbatch script for ``spec.nnodes`` nodes x ``spec.nproc_per_node`` ranks; the job's
    output (and the deepspeed hostfile) go to ``log_dir``, an absolute path."""
    node_spec = dataclasses.replace(
        spec,
        launcher=options.inner,
        node_rank=NODE_RANK,
        master_addr=HEAD,
        master_port=PORT,
        rdzv_id=JOB_ID,
        hostfile=HOSTFILE if options.inner == "deepspeed" else None,
        no_ssh=True,
    )
    inner = LAUNCHERS[options.inner](node_spec, train_args)
    check_directive_text(log_dir, OUT_FIELD)
    # %% is SLURM's own escape for a % in a file name pattern (%x: the job name, %j: its id)
    directives = [
        directive("job-name", job_name, JOB_NAME_FIELD),
        f"--nodes={spec.nnodes}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={cpus_per_task}",
        directive("output", log_dir.replace("%", "%%") + "/%x-%j.out", OUT_FIELD),
    ]
    if spec.device == "cuda":
        directives.append(f"--gpus-per-node={spec.nproc_per_node}")
    directives += [
        directive(key, value, f"--{key} (a study: slurm.{key})")
        for key, value in (("time", options.time), ("partition", options.partition), ("account", options.account))
        if value
    ]
    env = {**inner.env, "KANSCALE_LAUNCHER": "slurm"}
    port = str(spec.master_port) if spec.master_port is not None else JOB_PORT
    lines = [
        "#!/usr/bin/env bash",
        f"# Generated by kanscale: {spec.nnodes} node(s) x {spec.nproc_per_node} rank(s) on {spec.device}, "
        f"{options.inner} on each node.",
        *[f"#SBATCH {d}" for d in directives],
        "set -euo pipefail",
        f"cd {shlex.quote(os.getcwd())}  # where relative paths in --set overrides are relative to",
        'nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))',
        "export head_node=${nodes[0]}",
        "# the address SLURM reaches the head node at: a node name need not resolve as a host name",
        "head_addr=$(scontrol show node \"$head_node\" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')",
        "export head_addr=${head_addr:-$head_node}",
        f"export MASTER_PORT={port}",
        *[f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())],
    ]
    if options.inner == "deepspeed":
        lines += [
            f"export hostfile={shlex.quote(log_dir)}/hostfile-$SLURM_JOB_ID",
            f'printf "%s slots={spec.nproc_per_node}\\n" "${{nodes[@]}}" > "$hostfile"',
        ]
    # Quoted whole for bash -c, so that the script variables in it ($SLURM_NODEID) are expanded
    # by each node's own shell, and nothing else by any shell.
    node_command = shlex.quote(shell_join(inner.commands[0]))
    # srun is given the cores again: from SLURM 22.05 on, a step no longer inherits --cpus-per-task
    lines.append(
        f"srun --kill-on-bad-exit=1 --nodes={spec.nnodes} --ntasks-per-node=1 --cpus-per-task={cpus_per_task} "
        f"bash -c {node_command}"
    )
    return "\n".join(lines) + "\n"


def directive(option: str, value: object, field: str) -> str:
    """``--option=value`` for an #SBATCH line, as sbatch splits its directives: at white space
    outside quotes, with ``\\`` escaping and ``#`` starting a comment (sbatch's _get_argument)."""
    text = str(value)
    check_directive_text(text, field)
    if option == "job-name" and "/" in text:
        raise ConfigError(f"{field}: {text!r} holds a '/', but the job name also names the script file; remove it")
    if not SBATCH_PLAIN.fullmatch(text):
        text = '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return f"--{option}={text}"


def check_directive_text(text: str, field: str) -> None:
    """Refuse what no quoting keeps inside one #SBATCH directive: a line break would end it and
    have bash run the rest as a command; 'hetjob' starts another job component."""
    if any(not c.isprintable() for c in text):
        raise ConfigError(
            f"{field}: {text!r} holds a line break or control character, which would end its #SBATCH line "
            "and have bash run the rest as a command; remove it"
        )
    if re.search("hetjob|packjob", text, re.IGNORECASE):
        raise ConfigError(
            f"{field}: {text!r}: sbatch reads 'hetjob' (or 'packjob') anywhere in an #SBATCH line as the "
            "start of another job component; choose a value without it"
        )


def slurm_launch(
    spec: LaunchSpec, options: SlurmOptions, train_args: list[str], job_name: str, log_dir: Path, cpus_per_task: int = 1
) -> Launch:
    """Writing the script (``log_dir/<job>-<inner>-<nodes>x<ranks>.sbatch``) is the launch;
    submitting it is a separate, explicit step (:func:`write_script`)."""
    log_dir = log_dir.resolve()
    script = log_dir / f"{job_name}-{options.inner}-{spec.nnodes}x{spec.nproc_per_node}.sbatch"
    return Launch(
        commands=[["sbatch", str(script)]],
        files={script: sbatch_script(spec, options, train_args, job_name, str(log_dir), cpus_per_task)},
    )


def write_script(launch: Launch, submit_job: bool = False) -> tuple[Path, str | None]:
    """Write a SLURM launch's sbatch script and, with ``submit_job``, submit it. Returns the
    script and, when submitted, what :func:`submit` answered (None otherwise: the caller says
    how to submit it)."""
    ((script, text),) = launch.files.items()
    script.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(script, text)
    return script, submit(script) if submit_job else None


def submit(script_path: Path) -> str:
    """Submit with sbatch where it exists; otherwise say how to."""
    if shutil.which("sbatch") is None:
        return (
            f"sbatch is not available on this machine; copy the checkout to your cluster and run: "
            f"sbatch {shlex.quote(str(script_path))}"
        )
    done = subprocess.run(["sbatch", str(script_path)], capture_output=True, text=True)
    if done.returncode != 0:
        raise ConfigError(f"sbatch refused {script_path}: {done.stderr.strip()}")
    return done.stdout.strip()
