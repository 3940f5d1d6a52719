"""``kanscale run``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from launchers.cli.common import add_experiment_options, common_options, experiment_overrides


def register(subcommands: argparse._SubParsersAction) -> None:
    run = subcommands.add_parser("run", parents=[common_options()], help="check an experiment, then start its ranks with a launcher",
                         description="Check the experiment against the launch (world size, batch split, this machine's "
                                     "devices, the launcher, hostfiles), then start every rank with the chosen launcher; "
                                     "--dry-run prints the exact commands and files instead.")
    run.add_argument("config", help="experiment YAML")
    add_experiment_options(run)
    launch = run.add_argument_group("launch")
    launch.add_argument("--launcher", choices=["torchrun", "accelerate", "deepspeed", "slurm", "none"], default="torchrun")
    launch.add_argument("--nproc-per-node", type=int, default=1, metavar="G", help="ranks per node (GPUs per node)")
    launch.add_argument("--nnodes", type=int, default=1, metavar="N", help="number of nodes")
    launch.add_argument("--node-rank", type=int, default=0, metavar="R", help="this node's rank (start one run per node)")
    launch.add_argument("--master-addr", default="127.0.0.1", metavar="A", help="address of node 0 (rendezvous host)")
    launch.add_argument("--master-port", type=int, default=29500, metavar="P")
    launch.add_argument("--rdzv-id", default="kanscale", help="torchrun rendezvous (job) id, the same on every node")
    launch.add_argument("--hostfile", metavar="F", help="deepspeed: 'host slots=N' per node")
    launch.add_argument("--hosts", help="deepspeed: comma-separated hosts; writes OUT/hostfile with --nproc-per-node slots each")
    launch.add_argument("--no-ssh", action="store_true", help="deepspeed: start this node only (--node-rank), no ssh to the others")
    launch.add_argument("--accelerate-config", metavar="F", help="accelerate launch config (default: the strategy's, else "
                                                                "configs/accelerate/ddp_cpu.yaml or ddp.yaml)")
    launch.add_argument("--oversubscribe", action="store_true", help="allow more ranks than CPU cores on this machine")
    slurm = run.add_argument_group("slurm")
    slurm.add_argument("--inner-launcher", choices=["torchrun", "deepspeed", "accelerate"], default="torchrun",
                       help="what srun starts on each node")
    slurm.add_argument("--time", help="sbatch --time, e.g. 01:00:00")
    slurm.add_argument("--partition", help="sbatch --partition")
    slurm.add_argument("--account", help="sbatch --account")
    slurm.add_argument("--submit", action="store_true", help="submit the script with sbatch (where sbatch exists)")
    run.add_argument("--dry-run", action="store_true", help="print the commands and files, run nothing")
    run.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from launchers.commands import LaunchSpec
    from launchers.run import RunRequest, execute, plan
    from launchers.slurm import SlurmOptions, write_script
    from strategies.experiment import load_experiment

    overrides = experiment_overrides(args)
    out = args.out or load_experiment(args.config, overrides, strategy=args.strategy).output.dir
    spec = LaunchSpec(launcher=args.launcher, nproc_per_node=args.nproc_per_node, nnodes=args.nnodes,
                      node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
                      rdzv_id=args.rdzv_id, hostfile=args.hostfile, no_ssh=args.no_ssh,
                      accelerate_config=args.accelerate_config)
    request = RunRequest(config=args.config, out=out, spec=spec, overrides=overrides, strategy=args.strategy,
                         hosts=[h for h in (args.hosts or "").split(",") if h], oversubscribe=args.oversubscribe,
                         slurm=SlurmOptions(inner=args.inner_launcher, time=args.time, partition=args.partition,
                                            account=args.account),
                         job_name=f"kanscale-{Path(args.config).stem}")
    cfg, request, launch = plan(request)
    if args.dry_run:
        preview = cfg.strategy.backend_config_preview(cfg.training, request.spec.world_size)
        if preview is not None:
            title, config = preview
            print(f"# {title}:\n" + "".join(f"#   {line}\n" for line in json.dumps(config, indent=2).splitlines()), end="")
        print(launch.render())
        return 0
    if request.spec.launcher == "slurm":
        script, reply = write_script(launch, args.submit)
        print(f"wrote {script}", file=sys.stderr)
        print(reply or f"submit it with: sbatch {script} (or rerun with --submit)", file=sys.stderr)
        return 0
    return execute(launch)

