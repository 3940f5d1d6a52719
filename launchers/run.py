"""``kanscale run``: check an experiment against the launch it is meant for, build the launcher's
commands, and run them (or print them with ``--dry-run``).

Everything that can be found out before a process starts is checked here: the config, the
strategy at this world size, the batch split, whether this machine can hold the ranks, whether
the launcher is installed, whether a hostfile parses.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kanscale.errors import ConfigError
from kanscale.files import find_file, read_mapping
from launchers.commands import LAUNCHERS, Launch, LaunchSpec
from launchers.hostfile import Host, hostfile_text, parse_hostfile
from launchers.slurm import SlurmOptions, slurm_launch
from strategies.accelerate import launch_config_conflicts
from strategies.experiment import ExperimentConfig, load_experiment
from strategies.failures import raise_on_sigterm
from strategies.preflight import preflight

LAUNCHER_PACKAGES = {"torchrun": "torch", "accelerate": "accelerate", "deepspeed": "deepspeed"}


@dataclass
class RunRequest:
    """One experiment and how to launch it, as ``kanscale run`` or a sweep point asks for it."""

    config: str
    out: str
    spec: LaunchSpec = field(default_factory=LaunchSpec)
    overrides: list[str] = field(default_factory=list)
    strategy: str | None = None
    slurm: SlurmOptions = field(default_factory=SlurmOptions)  # how the sbatch script asks for the job (--launcher slurm)
    job_name: str | None = None  # the SLURM job's name; default kanscale-<experiment name>
    hosts: list[str] = field(default_factory=list)  # write a hostfile for these nodes
    oversubscribe: bool = False
    all_nodes_here: bool = False  # start every node on this machine (multi-node without a cluster)
    progress: bool = True
    resume: str | None = None  # a run directory to continue from its latest checkpoint

    def train_args(self) -> list[str]:
        """What every rank's ``kanscale train`` gets: the same config, preset and overrides."""
        args = [self.config] + (["--strategy", self.strategy] if self.strategy else [])
        for override in self.overrides:
            args += ["--set", override]
        args += ["--resume", self.resume] if self.resume else []
        return args + ["--out", self.out] + ([] if self.progress else ["--no-progress"])

    def load(self) -> ExperimentConfig:
        return load_experiment(self.config, [*self.overrides, f"output.dir={self.out}"], strategy=self.strategy)


def target_device(cfg: ExperimentConfig, launcher: str) -> str:
    """Where the ranks will run: SLURM jobs go to GPU nodes unless the config says cpu."""
    if cfg.runtime.device != "auto":
        return cfg.runtime.device
    return "cuda" if torch.cuda.is_available() or launcher == "slurm" else "cpu"


def resolve(request: RunRequest, cfg: ExperimentConfig) -> RunRequest:
    """Fill in what the request leaves to the experiment and the hosts: the device, the
    accelerate config, the node count and ranks per node a host list implies."""
    spec = dataclasses.replace(request.spec, device=target_device(cfg, request.spec.launcher))
    if starts_accelerate(request):
        default = f"configs/accelerate/{'ddp' if spec.device == 'cuda' else 'ddp_cpu'}.yaml"
        sources = [("--accelerate-config", spec.accelerate_config), ("strategy", cfg.strategy.launch_config()),
                   ("--accelerate-config", default)]
        source, chosen = next((name, path) for name, path in sources if path)
        # accelerate launch reads the file from its own working directory: hand it the file found here
        spec = dataclasses.replace(spec, accelerate_config=str(find_file(chosen, source, "accelerate config")))
    hosts = parse_hostfile(spec.hostfile) if spec.hostfile else [Host(h, spec.nproc_per_node) for h in request.hosts]
    if hosts:
        if spec.launcher != "deepspeed":
            raise ConfigError("--hostfile/--hosts: host lists are for the deepspeed launcher; torchrun and accelerate "
                              "take --nnodes, --node-rank and --master-addr")
        slots = sorted({h.slots for h in hosts})
        if len(slots) > 1:
            raise ConfigError(f"--hostfile: every host needs the same number of slots (ranks per node), got {slots}")
        spec = dataclasses.replace(spec, nnodes=len(hosts), nproc_per_node=slots[0])
    return dataclasses.replace(request, spec=spec)


def starts_accelerate(request: RunRequest) -> bool:
    """Whether ``accelerate launch`` starts the ranks: here, or on each node of a SLURM job."""
    spec = request.spec
    return spec.launcher == "accelerate" or (spec.launcher == "slurm" and request.slurm.inner == "accelerate")


def check_launch(cfg: ExperimentConfig, request: RunRequest) -> None:
    """Refuse a launch that cannot work, before anything starts."""
    spec = request.spec
    if spec.launcher == "none" and spec.world_size > 1:
        raise ConfigError(f"--launcher none starts one process; use torchrun, accelerate, deepspeed or slurm for "
                          f"{spec.world_size} ranks")
    if not 0 <= spec.node_rank < spec.nnodes:
        raise ConfigError(f"--node-rank: {spec.node_rank} is not between 0 and --nnodes - 1 ({spec.nnodes - 1})")
    package = LAUNCHER_PACKAGES.get(spec.launcher)
    if package and importlib.util.find_spec(package) is None:
        raise ConfigError(f"--launcher {spec.launcher}: {package} is not installed here; pip install {package} or pick "
                          "another launcher")
    preflight(cfg, spec.device, spec.world_size)
    if spec.launcher != "slurm":
        check_capacity(spec.device, spec.nproc_per_node * (spec.nnodes if request.all_nodes_here else 1),
                       request.oversubscribe)
    if starts_accelerate(request):
        path = spec.accelerate_config  # found by resolve()
        settings = read_mapping(path, "--accelerate-config", what="an accelerate launch config (a mapping)")
        problems = launch_config_conflicts(settings, cfg.training, spec.device, spec.world_size)
        if problems:
            raise ConfigError(f"--accelerate-config: {path}: " + "; ".join(problems))


def check_capacity(device: str, ranks_here: int, oversubscribe: bool = False) -> None:
    """Refuse more ranks than this machine has GPUs, or (unless asked) CPU cores."""
    if device == "cuda" and ranks_here > torch.cuda.device_count():
        raise ConfigError(f"--nproc-per-node: {ranks_here} rank(s) need {ranks_here} GPUs on this machine but it has "
                          f"{torch.cuda.device_count()}; lower --nproc-per-node or use more nodes")
    if device == "cpu" and ranks_here > (os.cpu_count() or 1) and not oversubscribe:
        raise ConfigError(f"--nproc-per-node: {ranks_here} rank(s) on this machine's {os.cpu_count()} CPU cores would "
                          "share cores and make the timings meaningless; lower --nproc-per-node (or pass --oversubscribe)")


def build_launch(request: RunRequest, cfg: ExperimentConfig) -> Launch:
    spec, train_args = request.spec, request.train_args()
    if spec.launcher == "slurm":
        return slurm_launch(spec, request.slurm, train_args, job_name=request.job_name or f"kanscale-{cfg.name}",
                            log_dir=Path(request.out) / "slurm")
    files = {}
    if request.hosts:
        hostfile = Path(request.out) / "hostfile"
        files[hostfile] = hostfile_text([Host(h, spec.nproc_per_node) for h in request.hosts])
        spec = dataclasses.replace(spec, hostfile=str(hostfile))
    ranks = range(spec.nnodes) if request.all_nodes_here else [spec.node_rank]
    launches = [LAUNCHERS[spec.launcher](dataclasses.replace(spec, node_rank=r), train_args) for r in ranks]
    return Launch(commands=[c for launch in launches for c in launch.commands], env=launches[0].env, files=files)


def plan(request: RunRequest) -> tuple[ExperimentConfig, RunRequest, Launch]:
    """Validate everything and build the commands; nothing runs yet."""
    cfg = request.load()
    request = resolve(request, cfg)
    check_launch(cfg, request)
    return cfg, request, build_launch(request, cfg)


def execute(launch: Launch, log: Path | None = None) -> int:
    """Write the launch's files, start its commands together and wait. If one fails, the others
    are stopped rather than left waiting for it; if this process is interrupted or terminated,
    all of them are. Returns the first non-zero exit code, or 0."""
    raise_on_sigterm()
    for path, text in launch.files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    env = {**os.environ, **launch.env}
    sink = open(log, "a") if log else None
    procs: list[subprocess.Popen] = []
    try:
        for i, cmd in enumerate(launch.commands):
            if i:
                time.sleep(1.0)  # node 0 first: it hosts the rendezvous
            procs.append(subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT if sink else None,
                                          start_new_session=True))
        codes = wait_all(procs)
    except BaseException:
        stop_all(procs)
        raise
    finally:
        if sink:
            sink.close()
    return next((c for c in codes if c != 0), 0)


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
