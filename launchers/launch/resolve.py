"""Fill in what a run request leaves open, from the files and the environment it names.

The command line decides what it sets; what it leaves out comes from the user's own files
before any default: the accelerate launch config's process counts, machine rank, address and
port; the hostfile's nodes and slots; the cluster's ``MASTER_PORT``. Where the command line and
a file disagree the run is refused, naming both, instead of one silently winning.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from kanscale.errors import ConfigError
from kanscale.files import find_file, read_mapping
from launchers.launch.commands import Device, LaunchSpec
from launchers.launch.hostfile import Host, check_host_name, parse_hostfile
from launchers.launch.ports import rendezvous_port
from launchers.launch.request import RunRequest
from launchers.launch.slurm import cluster_device
from strategies.experiment import ExperimentConfig

# LaunchSpec field -> its command-line option and the accelerate launch config key that sets it
ACCELERATE_KEYS = {
    "nnodes": ("--nnodes", "num_machines"),
    "nproc_per_node": ("--nproc-per-node", "num_processes"),  # the file counts every machine's processes
    "node_rank": ("--node-rank", "machine_rank"),
    "master_addr": ("--master-addr", "main_process_ip"),
    "master_port": ("--master-port", "main_process_port"),
}
# under SLURM the job places the nodes: only the sizes may come from the file
SLURM_PLACED = ("node_rank", "master_addr", "master_port")


def target_device(cfg: ExperimentConfig, request: RunRequest) -> Device:
    """Where the ranks will run: the experiment's runtime.device where it names one; on a SLURM
    cluster what its nodes have (``--slurm-device``); here, a GPU if this machine has one."""
    if cfg.runtime.device == "cpu" or cfg.runtime.device == "cuda":
        return cfg.runtime.device
    if request.spec.launcher == "slurm":
        return cluster_device(request.slurm)
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve(request: RunRequest, cfg: ExperimentConfig) -> RunRequest:
    """The request with its device, accelerate config, nodes, ranks per node, head address and
    port decided."""
    spec = dataclasses.replace(request.spec, device=target_device(cfg, request))
    request = dataclasses.replace(request, spec=spec)
    if request.starts_accelerate:
        request = with_accelerate_config(request, cfg)
    request = with_hosts(request)
    spec = request.spec
    if spec.launcher == "slurm":
        return request  # the job script picks the port where none is given (launchers.launch.slurm)
    if spec.master_port is not None:
        source = "--master-port" if "master_port" in request.given else "main_process_port in the accelerate config"
        return dataclasses.replace(request, port_source=source)
    port, source = rendezvous_port(every_node_here=spec.nnodes == 1 or request.all_nodes_here)
    return dataclasses.replace(request, spec=dataclasses.replace(spec, master_port=port), port_source=source)


def with_accelerate_config(request: RunRequest, cfg: ExperimentConfig) -> RunRequest:
    """Pick the accelerate launch config (``--accelerate-config``, else the strategy's, else the
    suite's DDP one) and take from it what the command line leaves out."""
    spec = request.spec
    default = f"configs/accelerate/{'ddp' if spec.device == 'cuda' else 'ddp_cpu'}.yaml"
    sources = [
        ("--accelerate-config", spec.accelerate_config),
        ("strategy", cfg.strategy.launch_config()),
        ("--accelerate-config", default),
    ]
    source, chosen = next((name, path) for name, path in sources if path)
    # accelerate launch reads the file from its own working directory: hand it the file found here
    path = find_file(chosen, source, "accelerate config")
    settings = read_mapping(path, source, what="an accelerate launch config (a mapping)")
    from_file = accelerate_launch_values(settings, path)
    if spec.launcher == "slurm":
        from_file = {k: v for k, v in from_file.items() if k not in SLURM_PLACED}
    contradictions = [
        f"{ACCELERATE_KEYS[name][0]} {getattr(spec, name)} but {describe_file_value(name, value, settings)}"
        for name, value in from_file.items()
        if name in request.given and getattr(spec, name) != value
    ]
    if contradictions:
        raise ConfigError(
            f"--accelerate-config: {path}: "
            + "; ".join(contradictions)
            + "; drop the option to use the file's value, or change the file"
        )
    taken = {name: value for name, value in from_file.items() if name not in request.given}
    return dataclasses.replace(request, spec=dataclasses.replace(spec, accelerate_config=str(path), **taken))


def accelerate_launch_values(settings: dict[str, Any], path: Path) -> dict[str, Any]:
    """What an accelerate launch config says about where the ranks go, in LaunchSpec's terms."""
    values = {name: settings[key] for name, (_, key) in ACCELERATE_KEYS.items() if settings.get(key) not in (None, "")}
    for name in ("nnodes", "nproc_per_node", "node_rank", "master_port"):
        if name in values and (not isinstance(values[name], int) or isinstance(values[name], bool) or values[name] < 0):
            raise ConfigError(
                f"--accelerate-config: {path}: {ACCELERATE_KEYS[name][1]}: {values[name]!r} is not a whole number"
            )
    if "nproc_per_node" in values:
        machines = values.get("nnodes", 1)
        if machines < 1 or values["nproc_per_node"] % machines:
            raise ConfigError(
                f"--accelerate-config: {path}: num_processes: {values['nproc_per_node']} (every machine's "
                f"processes together) does not split evenly over num_machines: {machines}"
            )
        values["nproc_per_node"] //= machines
    return values


def describe_file_value(name: str, value: Any, settings: dict[str, Any]) -> str:
    key = ACCELERATE_KEYS[name][1]
    if name == "nproc_per_node":
        return (
            f"num_processes: {settings[key]} over num_machines: {settings.get('num_machines', 1)} is {value} per node"
        )
    return f"{key}: {value}"


def with_hosts(request: RunRequest) -> RunRequest:
    """Nodes and ranks per node from ``--hostfile`` or ``--hosts`` (deepspeed only); over ssh,
    node 0 is the first host unless --master-addr says otherwise."""
    spec = request.spec
    if spec.hostfile:
        hosts = parse_hostfile(spec.hostfile, spec.device)
    else:
        for name in request.hosts:
            check_host_name(name, "--hosts")
        hosts = [Host(h, spec.nproc_per_node) for h in request.hosts]
    if not hosts:
        return request
    if spec.launcher != "deepspeed":
        raise ConfigError(
            "--hostfile/--hosts: host lists are for the deepspeed launcher; torchrun and accelerate "
            "take --nnodes, --node-rank and --master-addr"
        )
    slots = hosts[0].slots
    if spec.hostfile and "nproc_per_node" in request.given and spec.nproc_per_node != slots:
        raise ConfigError(
            f"--nproc-per-node {spec.nproc_per_node} but the hostfile {spec.hostfile} gives every host "
            f"slots={slots}; drop --nproc-per-node or change the hostfile"
        )
    hostfile = spec.hostfile or str(Path(request.out) / "hostfile")  # --hosts: written there (launchers.launch.run)
    spec = dataclasses.replace(spec, nnodes=len(hosts), nproc_per_node=slots, hostfile=hostfile)
    if not spec.no_ssh and "master_addr" not in request.given:
        spec = dataclasses.replace(spec, master_addr=hosts[0].name)  # DeepSpeed's own choice: the first host
    return dataclasses.replace(request, spec=spec)


def hostnames(spec: LaunchSpec, request: RunRequest) -> list[str]:
    """The nodes of a deepspeed host list, in order (none without one)."""
    if request.hosts or spec.hostfile is None:
        return list(request.hosts)
    return [h.name for h in parse_hostfile(spec.hostfile, spec.device)]
