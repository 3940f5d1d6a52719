"""``kanscale run``."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from kanscale import log
from launchers.cli.common import add_experiment_options, at_least, common_options, experiment_overrides, port_number

logger = log.get(__name__)

# options whose absence lets a file (the accelerate launch config, the hostfile) decide
LAUNCH_OPTIONS = ("launcher", "nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port")


def register(subcommands: argparse._SubParsersAction) -> None:
    run = subcommands.add_parser(
        "run",
        parents=[common_options()],
        help="check an experiment, then start its ranks with a launcher",
        description="Check the experiment against the launch (world size, batch split, this machine's "
        "devices, the launcher, hostfiles), then start every rank with the chosen launcher; "
        "--dry-run prints the exact commands and files instead.",
    )
    run.add_argument("config", help="experiment YAML")
    add_experiment_options(run)
    launch = run.add_argument_group(
        "launch",
        "options left out come from the accelerate launch config or the "
        "hostfile where there is one, else the defaults shown; a contradiction is refused",
    )
    launch.add_argument(
        "--launcher",
        choices=["torchrun", "accelerate", "deepspeed", "slurm", "none"],
        help="what starts the ranks (default: the strategy's own, accelerate for accelerate, else torchrun)",
    )
    launch.add_argument(
        "--nproc-per-node", type=at_least(1), metavar="G", help="ranks per node (GPUs per node; default 1)"
    )
    launch.add_argument("--nnodes", type=at_least(1), metavar="N", help="number of nodes (default 1)")
    launch.add_argument(
        "--node-rank", type=at_least(0), metavar="R", help="this node's rank (start one run per node; default 0)"
    )
    launch.add_argument(
        "--master-addr",
        metavar="A",
        help="address of node 0, the rendezvous host (default 127.0.0.1; over ssh the hostfile's first host)",
    )
    launch.add_argument(
        "--master-port",
        type=port_number,
        metavar="P",
        help="rendezvous port (default: MASTER_PORT if exported, "
        "else a free port where every rank starts here, else 29500; under SLURM one per job)",
    )
    launch.add_argument("--rdzv-id", default="kanscale", help="torchrun rendezvous (job) id, the same on every node")
    launch.add_argument(
        "--hostfile", metavar="F", help="deepspeed: 'host slots=N' per node, read as DeepSpeed reads it"
    )
    launch.add_argument(
        "--hosts", help="deepspeed: comma-separated hosts; writes OUT/hostfile with --nproc-per-node slots each"
    )
    launch.add_argument(
        "--no-ssh", action="store_true", help="deepspeed: start this node only (--node-rank), no ssh to the others"
    )
    launch.add_argument("--ssh-port", type=port_number, metavar="P", help="deepspeed over ssh: the nodes' sshd port")
    launch.add_argument("--ssh-key", metavar="F", help="deepspeed over ssh: the private key that logs in to every node")
    launch.add_argument(
        "--accelerate-config",
        metavar="F",
        help="accelerate launch config (default: the strategy's, else configs/accelerate/ddp_cpu.yaml or ddp.yaml)",
    )
    launch.add_argument("--oversubscribe", action="store_true", help="allow more ranks than CPU cores on this machine")
    slurm = run.add_argument_group("slurm")
    slurm.add_argument(
        "--inner-launcher",
        choices=["torchrun", "deepspeed", "accelerate"],
        default="torchrun",
        help="what srun starts on each node",
    )
    slurm.add_argument(
        "--slurm-device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="what the nodes run on, when runtime.device is auto: cuda requests --gpus-per-node; "
        "auto asks the cluster with sinfo (default)",
    )
    slurm.add_argument("--time", help="sbatch --time, e.g. 01:00:00")
    slurm.add_argument("--partition", help="sbatch --partition")
    slurm.add_argument("--account", help="sbatch --account")
    slurm.add_argument("--submit", action="store_true", help="submit the script with sbatch (where sbatch exists)")
    run.add_argument("--dry-run", action="store_true", help="print the commands and files, run nothing")
    run.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from kanscale.errors import ConfigError
    from launchers.launch.commands import LaunchSpec, launcher_name
    from launchers.launch.request import RunRequest
    from launchers.launch.run import check_rereadable, execute, plan
    from launchers.launch.slurm import SlurmOptions, write_script
    from strategies.experiment import load_experiment
    from strategies.native_training import with_native_training

    # before this process reads them: the experiment is read here and again by every rank, the
    # others by the ranks or the launcher (plan() checks the experiment again, for sweeps)
    for path, option in (
        (args.deepspeed_config, "--deepspeed-config"),
        (args.accelerate_config, "--accelerate-config"),
        (args.hostfile, "--hostfile"),
        (args.config, "config"),
    ):
        check_rereadable(path, option)
    overrides = experiment_overrides(args)
    # loaded once, as every rank will load it (``--out`` is its output.dir), and handed to plan()
    cfg = with_native_training(
        load_experiment(
            args.config, overrides, strategy=args.strategy, settings={"output.dir": args.out} if args.out else None
        )
    )  # as every rank will train it
    given = {name: getattr(args, name) for name in LAUNCH_OPTIONS if getattr(args, name) is not None}
    launcher = launcher_name(given.pop("launcher", None) or cfg.strategy.preferred_launcher or "torchrun")
    if args.submit and launcher != "slurm":
        raise ConfigError(
            f"--submit: only a SLURM launch is submitted (--launcher slurm); --launcher {launcher} starts "
            "the ranks here, so drop --submit"
        )
    spec = LaunchSpec(
        launcher=launcher,
        **given,
        rdzv_id=args.rdzv_id,
        hostfile=args.hostfile,
        no_ssh=args.no_ssh,
        ssh_port=args.ssh_port,
        ssh_key=args.ssh_key,
        accelerate_config=args.accelerate_config,
    )
    request = RunRequest(
        config=args.config,
        out=args.out or cfg.output.dir,
        spec=spec,
        given=frozenset(given),
        overrides=overrides,
        strategy=args.strategy,
        hosts=[h for h in (args.hosts or "").split(",") if h],
        oversubscribe=args.oversubscribe,
        slurm=SlurmOptions(
            inner=args.inner_launcher,
            device=args.slurm_device,
            time=args.time,
            partition=args.partition,
            account=args.account,
        ),
    )
    cfg, request, launch = plan(request, cfg)
    if args.dry_run:
        preview = cfg.strategy.backend_config_preview(cfg.training, request.spec.world_size)
        if preview is not None:
            title, config = preview
            print(
                f"# {title}:\n" + "".join(f"#   {line}\n" for line in json.dumps(config, indent=2).splitlines()), end=""
            )
        print(launch.render())
        return 0
    if request.spec.launcher == "slurm":
        script, reply = write_script(launch, args.submit)
        logger.info(f"wrote {script}")
        logger.info(reply or f"submit it with: sbatch {shlex.quote(str(script))} (or rerun with --submit)")
        return 0
    return execute(launch, runs=Path(request.out))
