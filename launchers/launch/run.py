"""``kanscale run``: check an experiment against the launch it is meant for, build the launcher's
commands, and run them (or print them with ``--dry-run``).

Everything that can be found out before a process starts is checked here: the config, the
strategy at this world size, the batch split, whether this machine can hold the ranks, whether
the launcher is installed, whether a hostfile parses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import ipaddress
import os
import signal
import subprocess
import time
from pathlib import Path

import torch

from kanscale import log
from kanscale.errors import ConfigError
from kanscale.files import read_mapping
from kanscale.writes import atomic_write_text, open_to_append
from launchers.cli.common import PORTS
from launchers.launch.commands import LAUNCHERS, Launch
from launchers.launch.hostfile import Host, hostfile_text
from launchers.launch.ports import check_port_free
from launchers.launch.request import RunRequest
from launchers.launch.resolve import ACCELERATE_KEYS, hostnames, resolve
from launchers.launch.slurm import slurm_launch
from launchers.launch.ssh import check_ssh_path, deepspeed_env_text
from strategies.backends.accelerate_launch import launch_config_conflicts
from strategies.experiment import ExperimentConfig
from strategies.lifecycle.failures import raise_on_sigterm
from strategies.lifecycle.preflight import Machines, check_device, preflight
from strategies.lifecycle.resume import discard_abandoned_saves

logger = log.get(__name__)

LAUNCHER_PACKAGES = {"torchrun": "torch", "accelerate": "accelerate", "deepspeed": "deepspeed"}


def check_rereadable(path: str | None, field: str) -> None:
    """Refuse a file the launched processes read again that can be read only once: every rank
    reads the experiment (and its DeepSpeed JSON) itself, and the launchers read their own
    configs, but a pipe (bash's ``<(...)``, a /dev/fd/N that exists in this process only) or a
    FIFO gives its text to the first reader. A name that is no file here is left to the lookup
    that follows (a shipped preset, "does not exist")."""
    if path is None or not os.path.exists(path) or os.path.isfile(path) or os.path.isdir(path):
        return
    raise ConfigError(
        f"{field}: {path} is not a regular file (a pipe such as bash's <(...) gives, a FIFO or a device), "
        "and every launched process reads it again, which a pipe allows once and only in this process; "
        "write it to a file first (e.g. sed ... > my.yaml) and give that file"
    )


def check_launch(cfg: ExperimentConfig, request: RunRequest) -> None:
    """Refuse a launch that cannot work, before anything starts."""
    spec = request.spec
    if spec.launcher == "none" and spec.world_size > 1:
        raise ConfigError(
            f"--launcher none starts one process; use torchrun, accelerate, deepspeed or slurm for "
            f"{spec.world_size} ranks"
        )
    check_sizes_and_port(request)
    # an int from the command line: a script variable ($SLURM_NODEID) enters only the SLURM script built later
    if isinstance(spec.node_rank, int) and not 0 <= spec.node_rank < spec.nnodes:
        raise ConfigError(f"--node-rank: {spec.node_rank} is not between 0 and --nnodes - 1 ({spec.nnodes - 1})")
    if (spec.ssh_port or spec.ssh_key) and not request.over_ssh:
        raise ConfigError(
            "--ssh-port/--ssh-key: ssh starts the nodes only with --launcher deepspeed and a hostfile "
            "(--hostfile or --hosts) without --no-ssh"
        )
    # found by resolve(); read here for what it says about the launch
    settings = (
        read_mapping(spec.accelerate_config, "--accelerate-config", what="an accelerate launch config (a mapping)")
        if request.starts_accelerate and spec.accelerate_config is not None
        else {}
    )
    check_master_addr(request, settings)
    package = LAUNCHER_PACKAGES.get(spec.launcher)
    if package and importlib.util.find_spec(package) is None:
        raise ConfigError(
            f"--launcher {spec.launcher}: {package} is not installed here; pip install {package} or pick "
            "another launcher"
        )
    machines = launch_machines(request)
    check_device(cfg, spec.device)  # before the GPU count: the plainer message
    if machines.like_this_one:
        check_capacity(spec.device, machines.ranks_here, request.oversubscribe)
    preflight(cfg, spec.device, spec.world_size, machines, ranks_per_node=spec.nproc_per_node)
    if hosts_rendezvous_here(request) and isinstance(spec.master_port, int):  # resolved: no script variable
        check_port_free(spec.master_port, request.port_source)
    if request.over_ssh:
        check_ssh_path(hostnames(spec, request), spec.ssh_port, spec.ssh_key)
    if request.starts_accelerate:
        problems = launch_config_conflicts(settings, cfg.training, spec.device, spec.world_size, model=cfg.model)
        if problems:
            raise ConfigError(f"--accelerate-config: {spec.accelerate_config}: " + "; ".join(problems))


def check_sizes_and_port(request: RunRequest) -> None:
    """The sizes and the port as resolved, wherever they came from (the command line checks its
    own; an accelerate config or MASTER_PORT may say 0 processes or port 70000)."""
    spec = request.spec
    for name in ("nproc_per_node", "nnodes"):
        value = getattr(spec, name)
        if value < 1:
            option, key = ACCELERATE_KEYS[name]
            source = option if name in request.given else f"{key} in the accelerate config {spec.accelerate_config}"
            raise ConfigError(f"{option}: {value} (from {source}) leaves no ranks to start; give at least 1")
    if isinstance(spec.master_port, int) and spec.master_port not in PORTS:
        raise ConfigError(
            f"--master-port: {spec.master_port} (from {request.port_source or '--master-port'}) is not a "
            "port number; give one from 1 to 65535"
        )


def check_master_addr(request: RunRequest, accelerate_settings: dict) -> None:
    """Refuse a launch over several nodes that nothing tells where node 0 is. Without an address
    every node waits on its own 127.0.0.1 for a rendezvous that never comes. SLURM, ssh from a
    hostfile, and a sweep that starts every node here decide the address themselves."""
    spec = request.spec
    if (
        spec.nnodes == 1
        or spec.launcher in ("slurm", "none")
        or request.all_nodes_here
        or request.over_ssh
        or "master_addr" in request.given
        or accelerate_settings.get("main_process_ip")
    ):
        return
    first = hostnames(spec, request)[0] if spec.hostfile else None
    if first is not None and is_loopback(first):
        return  # every node of the host list is this machine: 127.0.0.1 is node 0
    example = first or "NODE0"
    raise ConfigError(
        f"--master-addr: {spec.nnodes} nodes meet at node 0's address, and none was given, so every node "
        f"would wait on its own 127.0.0.1 for the others; give --master-addr {example} (node 0's host name "
        "or address, the same on every node), or let --launcher slurm or a deepspeed hostfile over ssh "
        "place the nodes"
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def launch_machines(request: RunRequest) -> Machines:
    """Where the launch's ranks run, for the memory and core checks."""
    spec = request.spec
    if spec.launcher == "slurm":
        return Machines(spec.nnodes, spec.nproc_per_node, like_this_one=False)
    if request.all_nodes_here:
        return Machines(1, spec.world_size)
    return Machines(spec.nnodes, spec.nproc_per_node)


def hosts_rendezvous_here(request: RunRequest) -> bool:
    """Whether a process started from here listens on the master port on this machine (node 0
    of a launch that uses the port; torchrun on one node picks its own)."""
    spec = request.spec
    if spec.launcher in ("slurm", "none") or request.over_ssh or (spec.launcher == "torchrun" and spec.nnodes == 1):
        return False
    return spec.node_rank == 0 or request.all_nodes_here


def check_capacity(device: str, ranks_here: int, oversubscribe: bool = False) -> None:
    """Refuse more ranks than this machine has GPUs, or (unless asked) CPU cores."""
    if device == "cuda" and ranks_here > torch.cuda.device_count():
        raise ConfigError(
            f"--nproc-per-node: {ranks_here} rank(s) need {ranks_here} GPUs on this machine but it has "
            f"{torch.cuda.device_count()}; lower --nproc-per-node or use more nodes"
        )
    if device == "cpu" and ranks_here > (os.cpu_count() or 1) and not oversubscribe:
        raise ConfigError(
            f"--nproc-per-node: {ranks_here} rank(s) on this machine's {os.cpu_count()} CPU cores would "
            "share cores and make the timings meaningless; lower --nproc-per-node (or pass --oversubscribe)"
        )


def build_launch(request: RunRequest, cfg: ExperimentConfig) -> Launch:
    spec = request.spec
    if spec.launcher == "slurm":
        # SLURM resolves #SBATCH paths before the script's cd, from wherever sbatch ran: absolute paths only
        request = dataclasses.replace(
            request,
            out=str(Path(request.out).resolve()),
            config=str(Path(request.config).resolve()) if Path(request.config).is_file() else request.config,
        )
        job_name = request.job_name or f"kanscale-{cfg.name}-{cfg.strategy.label()}"
        return slurm_launch(
            spec,
            request.slurm,
            request.train_args(),
            job_name=job_name,
            log_dir=Path(request.out) / "slurm",
            cpus_per_task=spec.nproc_per_node * (cfg.runtime.threads or 1),
        )
    files = {}
    if request.hosts and spec.hostfile is not None:  # resolve() names the file it is written to
        files[Path(spec.hostfile)] = hostfile_text([Host(h, spec.nproc_per_node) for h in request.hosts])
    if request.over_ssh:
        env_file = Path(request.out).resolve() / ".deepspeed_env"
        files[env_file] = deepspeed_env_text(spec.device)
        spec = dataclasses.replace(spec, deepspeed_env_file=str(env_file))
    ranks = range(spec.nnodes) if request.all_nodes_here else [spec.node_rank]
    launches = [LAUNCHERS[spec.launcher](dataclasses.replace(spec, node_rank=r), request.train_args()) for r in ranks]
    return Launch(commands=[c for launch in launches for c in launch.commands], env=launches[0].env, files=files)


def plan(request: RunRequest, cfg: ExperimentConfig | None = None) -> tuple[ExperimentConfig, RunRequest, Launch]:
    """Validate everything and build the commands; nothing runs yet. ``cfg``: the request's
    experiment where the caller has loaded it already (:meth:`RunRequest.load` otherwise)."""
    check_rereadable(request.config, "config")  # before it is read: a FIFO without a writer would block
    cfg = cfg or request.load()
    request = resolve(request, cfg)
    check_launch(cfg, request)
    return cfg, request, build_launch(request, cfg)


def execute(launch: Launch, log: Path | None = None, runs: Path | None = None) -> int:
    """Write the launch's files, start its commands together and wait. If one fails, the others
    are stopped rather than left waiting for it; if this process is interrupted or terminated,
    all of them are. Returns the first non-zero exit code, or 0. ``runs``: the output directory,
    whose abandoned partial checkpoints a failed launch deletes once every rank has ended."""
    raise_on_sigterm()
    logger.debug(f"starting {len(launch.commands)} command(s):\n{launch.render()}")
    for path, text in launch.files.items():
        atomic_write_text(path, text)
    env = {**os.environ, **launch.env}
    procs: list[subprocess.Popen] = []
    with open_to_append(log) if log else contextlib.nullcontext() as sink:
        try:
            for i, cmd in enumerate(launch.commands):
                if i:
                    time.sleep(1.0)  # node 0 first: it hosts the rendezvous
                procs.append(
                    subprocess.Popen(
                        cmd, env=env, stdout=sink, stderr=subprocess.STDOUT if sink else None, start_new_session=True
                    )
                )
            codes = wait_all(procs)
        except BaseException:
            stop_all(procs)
            raise
    code = next((c for c in codes if c != 0), 0)
    if code and runs is not None:
        discard_abandoned_saves(runs)
    return code


def wait_all(procs: list[subprocess.Popen]) -> list[int]:
    while any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
            stop_all(procs)
        time.sleep(0.2)
    return [p.returncode for p in procs]


def stop_all(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM every still-running launch (its whole process group), SIGKILL after a grace period."""
    running = [p for p in procs if p.poll() is None]
    for proc in running:
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in running:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
