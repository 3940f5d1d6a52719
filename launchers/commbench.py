"""``kanscale commbench``: start the collective benchmark (strategies/commbench.py) on every rank
with torchrun, the same way training runs are started; each rank runs ``kanscale commbench
--worker``."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

from launchers.commands import Launch, LaunchSpec, free_port, torchrun_launch
from launchers.run import check_capacity, execute
from strategies.commbench import BenchOptions, run_worker
from kanscale.errors import ConfigError


def run_commbench(options: BenchOptions, nproc_per_node: int, nnodes: int, node_rank: int, master_addr: str,
                  master_port: int | None, oversubscribe: bool, worker: bool) -> int:
    try:
        options.check()
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if worker:
        return run_worker(options)
    if min(nproc_per_node, nnodes) < 1 or nproc_per_node * nnodes < 2:
        raise ConfigError("--nproc-per-node x --nnodes: a collective benchmark needs at least 2 ranks, e.g. "
                          "--nproc-per-node 2 (one node) or --nnodes 2 --nproc-per-node 1 (two nodes)")
    local = master_addr in ("127.0.0.1", "localhost")  # then every node starts here
    device = "cuda" if options.device == "cuda" or (options.device == "auto" and torch.cuda.is_available()) else "cpu"
    check_capacity(device, nproc_per_node * (nnodes if local else 1), oversubscribe)
    spec = LaunchSpec(nproc_per_node=nproc_per_node, nnodes=nnodes, master_addr=master_addr,
                      master_port=master_port or (free_port() if local else 29500), rdzv_id="kanscale-commbench")
    worker_args = ["--worker", *options.argv()]
    commands = [torchrun_launch(dataclasses.replace(spec, node_rank=r), worker_args, command="commbench").commands[0]
                for r in (range(nnodes) if local else [node_rank])]
    code = execute(Launch(commands))
    if code == 0 and (local or node_rank == 0):
        print(f"wrote {options.out} and {Path(options.out).with_suffix('.md')}", file=sys.stderr)
    return code
