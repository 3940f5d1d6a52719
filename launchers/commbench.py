"""``kanscale commbench``: all-reduce, reduce-scatter and all-gather over a sweep of message sizes,
run by every rank of a process group (gloo on CPUs, NCCL with CUDA tensors on GPUs), reported with
nccl-tests' definitions, plus a per-rank host copy (the link ZeRO's offload uses).

The sweep is powers of four plus the sizes the zoo's training actually moves: the gradients of the
study's model and of a ~20M-parameter B-spline KAN, a rank's 1/P shard of each, and a DDP bucket.
Each operation and size: warm-up iterations, then timed ones, each started after a barrier; a
time is the slowest rank's (a collective ends when its last rank does), reported as the median over
iterations. Sizes are the full buffer (for reduce-scatter and all-gather the gathered one), float32,
rounded up to a multiple of 4 P bytes. Per operation, time = alpha + beta * bytes is fitted and
turned into the link's per-step latency and inverse bus bandwidth (analysis.projection), for the
link the ranks span: intra-node on one node, inter-node across nodes.

``run_commbench`` starts the ranks with torchrun, the way training runs are started; every rank
runs this module, ``python -m launchers.commbench OPTIONS_JSON`` (``worker_main``), and rank 0
writes the JSON and its Markdown twin.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist

from analysis.projection import DDP_BUCKET, HOST_COPY, OPS, LinkCost, MiB, busbw_factor, fit_alpha_beta
from analysis.report.documents import json_out, write_json_and_markdown
from analysis.report.format import human_bytes
from analysis.report.tables import markdown
from kanscale import log
from kanscale.errors import ConfigError
from kanscale.extras import installed
from launchers.launch.commands import Launch, LaunchSpec, torchrun_launch
from launchers.launch.ports import rendezvous_port
from launchers.launch.run import check_capacity, execute
from launchers.shared_cores import measure_shared_cores, shared_cores_markdown
from launchers.zoo import model_shape
from strategies.measure.environment import environment_info
from strategies.runtime.distributed import DistEnv, device_name

logger = log.get(__name__)

WORKER = "launchers.commbench"  # the module every rank runs
# The models whose gradient and shard sizes the sweep includes.
ZOO = {
    "study pykan": {"family": "pykan", "widths": [2, 64, 1], "grid": 10, "k": 3, "seed": 42},
    "study bspline": {"family": "bspline", "widths": [2, 64, 1], "grid": 10},
    "20M bspline": {"family": "bspline", "widths": [256, 1024, 1024, 1], "grid": 10},
}
LARGE = 4 * MiB  # above this, fewer iterations: each already takes long
# reduce_scatter_single / all_gather_single replace the *_tensor names in newer torch
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Message:
    nbytes: int
    labels: tuple[str, ...] = ()


def message_sizes(world_size: int, min_bytes: int, max_bytes: int) -> list[Message]:
    """Powers of four from min_bytes to max_bytes plus the zoo's sizes in that range, each rounded
    up to a multiple of 4 * world_size bytes (float32, divisible into world_size shards)."""
    unit = 4 * world_size
    labelled: dict[int, list[str]] = {}

    def put(nbytes: float, label: str | None = None) -> None:
        size = unit * max(1, -(-int(nbytes) // unit))
        if min_bytes <= size <= max_bytes:
            labelled.setdefault(size, []).extend([label] if label else [])

    n = 4
    while n <= max_bytes:
        put(n)
        n *= 4
    for name, grads in zoo_gradient_bytes().items():
        put(grads, f"{name} gradients")
        put(grads / world_size, f"{name} gradient shard (1/{world_size})")
    put(DDP_BUCKET, f"DDP bucket ({DDP_BUCKET // MiB} MiB)")
    return [Message(size, tuple(labels)) for size, labels in sorted(labelled.items())]


@cache
def zoo_gradient_bytes() -> dict[str, int]:
    """fp32 gradient bytes of each ZOO model (built once: pykan's import alone takes seconds). The
    study's pykan model is measured only where the pykan extra is installed: the sizes are labels
    on the sweep, not a reason to refuse it."""
    return {
        name: 4 * model_shape(config).trainable
        for name, config in ZOO.items()
        if config["family"] != "pykan" or installed("kan")
    }


@dataclass(frozen=True)
class BenchOptions:
    out: str = "runs/commbench.json"
    min_bytes: int = 4
    max_bytes: int | None = None  # None: the largest zoo size
    iters: int = 20
    warmup: int = 5
    device: str = "auto"

    def check(self) -> None:
        """ConfigError naming the flag and the fix."""
        if self.min_bytes < 1:
            raise ConfigError(f"--min-bytes: must be at least 1, got {self.min_bytes}")
        if self.max_bytes is not None and self.max_bytes < 16 * self.min_bytes:
            raise ConfigError(
                f"--max-bytes: must be at least 16 x --min-bytes ({16 * self.min_bytes}) for two sizes "
                f"to fit latency and bandwidth to, got {self.max_bytes}"
            )
        if self.iters < 1 or self.warmup < 0:
            raise ConfigError(f"--iters must be at least 1 and --warmup at least 0, got {self.iters} and {self.warmup}")
        json_out(self.out)

    def to_json(self) -> str:
        """The options as every rank's worker receives them (``from_json`` reads them back)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> BenchOptions:
        return cls(**json.loads(text))


def iterations(nbytes: int, options: BenchOptions) -> tuple[int, int]:
    """(warm-up, timed) for a size: fewer above LARGE bytes, at least one warm-up and three timed."""
    scale = min(1.0, LARGE / nbytes)
    return max(1, round(options.warmup * scale)), max(3, round(options.iters * scale))


def time_op(env: DistEnv, op: str, nbytes: int, warmup: int, iters: int) -> list[float]:
    """Per timed iteration, the slowest rank's seconds."""
    n, dev = nbytes // 4, env.device
    full, shard = torch.ones(n, device=dev), torch.ones(n // env.world_size, device=dev)
    if op == HOST_COPY:  # pinned host memory to the device on GPUs, RAM to RAM on CPUs
        source = torch.ones(n, pin_memory=dev.type == "cuda")
    run = {
        "all_reduce": lambda: dist.all_reduce(full),
        "reduce_scatter": lambda: _reduce_scatter(shard, full),
        "all_gather": lambda: _all_gather(full, shard),
        HOST_COPY: lambda: full.copy_(source),
    }[op]
    times = torch.zeros(iters, dtype=torch.float64)
    for i in range(warmup + iters):
        env.synchronize()
        start = time.perf_counter()
        run()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i >= warmup:
            times[i - warmup] = time.perf_counter() - start
    times = times.to(dev)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times.cpu().tolist()


def measure(env: DistEnv, options: BenchOptions) -> list[dict[str, Any]]:
    """Every operation at every size; the sweep is rank 0's, so every rank runs the same one."""
    box: list[Any] = [None]
    if env.is_main:
        try:
            box[0] = message_sizes(
                env.world_size, options.min_bytes, options.max_bytes or max(zoo_gradient_bytes().values())
            )
        except Exception as err:  # sent on, so that no rank waits in the broadcast until its timeout
            box[0] = f"{type(err).__name__}: {err}"
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise RuntimeError(f"rank 0 could not size the messages: {box[0]}")
    rows = []
    for message in box[0]:
        warmup, iters = iterations(message.nbytes, options)
        for op in (*OPS, HOST_COPY):
            seconds = time_op(env, op, message.nbytes, warmup, iters)
            median = statistics.median(seconds)
            algbw = message.nbytes / median / 1e9
            rows.append(
                {
                    "op": op,
                    "bytes": message.nbytes,
                    "labels": list(message.labels),
                    "iters": iters,
                    "time_s": median,
                    "time_min_s": min(seconds),
                    "time_max_s": max(seconds),
                    "algbw_GBps": algbw,
                    "busbw_GBps": algbw * busbw_factor(op, env.world_size),
                }
            )
    return rows


def fits(rows: list[dict[str, Any]], world_size: int, link: str) -> list[dict[str, Any]]:
    """Per operation: alpha and beta of the whole operation, and of the link behind it."""
    out = []
    for op in (*OPS, HOST_COPY):
        mine = [r for r in rows if r["op"] == op]
        fit = fit_alpha_beta([r["bytes"] for r in mine], [r["time_s"] for r in mine])
        cost = LinkCost.from_fit(op, fit, world_size)
        out.append(
            {
                "op": op,
                "link": "host" if op == HOST_COPY else link,
                "alpha_s": fit.alpha_s,
                "beta_s_per_byte": fit.beta_s_per_byte,
                "rel_rms": fit.rel_rms,
                "link_alpha_s": cost.alpha_s,
                "link_beta_s_per_byte": cost.beta_s_per_byte,
                "link_busbw_GBps": 1 / cost.beta_s_per_byte / 1e9 if cost.beta_s_per_byte else None,
            }
        )
    return out


def report(doc: dict[str, Any]) -> str:
    """The measurements and fits as Markdown."""
    head = (
        f"Measured {doc['date']} on {doc['device_name']}: {doc['world_size']} ranks ({doc['nodes']} node(s) x "
        f"{doc['ranks_per_node']}), {doc['backend']}, link {doc['link']}, torch {doc['environment']['torch']}. "
        "Time: median over timed iterations of the slowest rank [min-max]; algbw = size / time; busbw = algbw "
        "x 2(n-1)/n (all-reduce) or (n-1)/n (reduce-scatter, all-gather; size = the gathered buffer); "
        "host_copy: each rank copies size bytes (host to device on GPUs, RAM to RAM on CPUs)."
    )
    results = pd.DataFrame(
        [
            {
                "op": r["op"],
                "size": human_bytes(r["bytes"]),
                "bytes": f"{r['bytes']:,}",
                "what": "; ".join(r["labels"]),
                "time us": f"{1e6 * r['time_s']:.1f} [{1e6 * r['time_min_s']:.1f}-{1e6 * r['time_max_s']:.1f}]",
                "algbw GB/s": f"{r['algbw_GBps']:.3f}",
                "busbw GB/s": f"{r['busbw_GBps']:.3f}",
            }
            for r in doc["results"]
        ]
    )
    fitted = pd.DataFrame(
        [
            {
                "op": f["op"],
                "link": f["link"],
                "alpha us": f"{1e6 * f['alpha_s']:.1f}",
                "beta ns/KiB": f"{1e9 * 1024 * f['beta_s_per_byte']:.2f}",
                "rel. rms error": f"{100 * f['rel_rms']:.0f}%",
                "link alpha us / step": f"{1e6 * f['link_alpha_s']:.1f}",
                "link busbw GB/s": f"{f['link_busbw_GBps']:.2f}" if f["link_busbw_GBps"] else "inf",
            }
            for f in doc["fits"]
        ]
    )
    text = (
        f"{head}\n\n{markdown(results)}\n\nFit of time = alpha + beta x size (least squares on relative "
        "residuals); per link: alpha / ring steps and beta / busbw factor.\n\n" + markdown(fitted) + "\n"
    )
    return text + shared_cores_markdown(doc.get("shared_cores") or [])


def run_worker(env: DistEnv, options: BenchOptions) -> int:
    """One rank: join the launch's process group, measure, and on rank 0 write the JSON and the
    Markdown table and print the table."""
    env.init_process_group(timeout_s=600)
    try:
        if env.world_size < 2:
            raise RuntimeError("commbench needs at least 2 ranks; start it with kanscale commbench --nproc-per-node 2")
        rows = measure(env, options)
        # CPU ranks compute on the cores they share; a GPU rank's kernels run on its own device
        shared = measure_shared_cores(env) if env.device.type == "cpu" else []
        environment = environment_info(env).model_dump()
        if env.is_main:
            link = "inter" if env.nodes > 1 else "intra"
            date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            doc = {
                "kind": "kanscale commbench",
                "date": date,
                "environment": environment,
                "backend": env.comm_backend,
                "device": env.device.type,
                "device_name": device_name(env.device),
                "world_size": env.world_size,
                "nodes": env.nodes,
                "ranks_per_node": env.local_world_size,
                "link": link,
                "options": asdict(options),
                "results": rows,
                "fits": fits(rows, env.world_size, link),
                "shared_cores": shared,
            }
            table = report(doc)
            write_json_and_markdown(options.out, doc, table)
            print(table, flush=True)
    finally:
        env.shutdown()
    return 0


def worker_main(argv: list[str] | None = None) -> int:
    """``python -m launchers.commbench OPTIONS_JSON [--debug]``: what every rank runs. Errors
    end as a subcommand's do (one line, exit 1 or 2); a rank that joined the process group leaves
    without tearing it down (launchers.cli.common.exit_without_teardown)."""
    from launchers.cli.common import exit_code, run_rank

    parser = argparse.ArgumentParser(
        prog=f"python -m {WORKER}",
        description="One rank of kanscale commbench; kanscale commbench starts it on every rank under torchrun.",
    )
    parser.add_argument("options", help="the benchmark's options as JSON (BenchOptions.to_json)")
    parser.add_argument("--debug", action="store_true", help="show Python tracebacks on errors")
    parser.set_defaults(command="commbench")
    args = parser.parse_args(argv)
    try:
        options = BenchOptions.from_json(args.options)
        env = DistEnv.from_environ(options.device)
        return run_rank(env, args, lambda: run_worker(env, options))
    except BaseException as err:
        return exit_code(err, args)


def rank_command(spec: LaunchSpec, options: BenchOptions, debug: bool = False) -> list[str]:
    """torchrun's command for one node of ``spec``, each of its ranks running ``worker_main``."""
    entry = ["-m", WORKER, options.to_json()] + (["--debug"] if debug else [])
    return torchrun_launch(spec, [], entry=entry).commands[0]


def run_commbench(
    options: BenchOptions,
    nproc_per_node: int,
    nnodes: int,
    node_rank: int,
    master_addr: str,
    master_port: int | None,
    oversubscribe: bool,
    debug: bool = False,
) -> int:
    """Check the options, start ``nnodes`` torchrun agents (all of them here with a local
    ``master_addr``, else this node's), wait for them and say where the results went."""
    options.check()
    if min(nproc_per_node, nnodes) < 1 or nproc_per_node * nnodes < 2:
        raise ConfigError(
            "--nproc-per-node x --nnodes: a collective benchmark needs at least 2 ranks, e.g. "
            "--nproc-per-node 2 (one node) or --nnodes 2 --nproc-per-node 1 (two nodes)"
        )
    local = master_addr in ("127.0.0.1", "localhost")  # then every node starts here
    device = "cuda" if options.device == "cuda" or (options.device == "auto" and torch.cuda.is_available()) else "cpu"
    check_capacity(device, nproc_per_node * (nnodes if local else 1), oversubscribe)
    port = master_port or rendezvous_port(every_node_here=local)[0]
    spec = LaunchSpec(
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        master_addr=master_addr,
        master_port=port,
        rdzv_id="kanscale-commbench",
    )
    commands = [
        rank_command(dataclasses.replace(spec, node_rank=r), options, debug)
        for r in (range(nnodes) if local else [node_rank])
    ]
    code = execute(Launch(commands))
    if code == 0 and (local or node_rank == 0):
        logger.info(f"wrote {options.out} and {Path(options.out).with_suffix('.md')}")
    return code


if __name__ == "__main__":
    sys.exit(worker_main())
