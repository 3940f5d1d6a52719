"""``kanscale``: train one experiment, list the model zoo, print the metrics schema."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from strategies.config import ConfigError

EPILOG = """examples:
  kanscale train configs/experiments/quickstart.yaml
  kanscale train configs/experiments/paper_kan64.yaml --set training.epochs=1 --out runs/paper
  torchrun --standalone --nproc_per_node 2 -m launchers.cli train configs/experiments/quickstart.yaml --strategy fsdp2
  kanscale run configs/experiments/quickstart.yaml --strategy zero3 --nproc-per-node 2
  kanscale run configs/experiments/paper_kan64.yaml --launcher slurm --nnodes 4 --nproc-per-node 2 --dry-run
  kanscale sweep configs/studies/strong_cpu.yaml --out runs/strong
  kanscale analyze runs/strong
  kanscale models --widths 2,64,1
  kanscale schema > run_record.schema.json
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kanscale", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train Kolmogorov-Arnold Networks under interchangeable parallelism strategies and "
                    "compare what each costs in time, communication and memory.")
    parser.add_argument("--debug", action="store_true", help="show Python tracebacks on errors")
    # The deepspeed launcher passes --local_rank=N before the subcommand; the rank comes from the
    # environment (LOCAL_RANK), which every launcher sets, so the flag is accepted and ignored.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    # --debug is accepted after the subcommand too; SUPPRESS keeps the subparser from resetting it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show Python tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser("train", parents=[common], help="train one experiment in this process (one rank of a launch)",
                           description="Train one experiment. Run it directly for one process, or under "
                                       "torchrun / accelerate launch / deepspeed for several ranks: every rank "
                                       "runs this same command and rank 0 writes the run record.")
    train.add_argument("config", help="experiment YAML, e.g. configs/experiments/quickstart.yaml")
    add_experiment_options(train)
    train.add_argument("--resume", nargs="?", const=True, default=False, metavar="RUN_DIR",
                       help="continue an unfinished run from its latest complete checkpoint (training.checkpoint_every): "
                            "the given run directory, or the newest resumable run of this experiment in output.dir")
    bar = train.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None, help="always show a progress bar")
    bar.add_argument("--no-progress", dest="progress", action="store_false", help="log lines instead of a progress bar")
    train.set_defaults(func=cmd_train)

    run = sub.add_parser("run", parents=[common], help="check an experiment, then start its ranks with a launcher",
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
    run.set_defaults(func=cmd_run)

    sweep = sub.add_parser("sweep", parents=[common], help="run every point of a study (configs/studies/*.yaml)",
                           description="Run every point of a study, one launch each, with a progress bar; a failed point "
                                       "is recorded and the sweep goes on. Studies whose launcher is slurm write one "
                                       "sbatch script per point instead.")
    sweep.add_argument("study", help="study YAML, e.g. configs/studies/strong_cpu.yaml")
    sweep.add_argument("--out", required=True, help="directory for the runs (and logs/, sweep.jsonl)")
    sweep.add_argument("--resume", action="store_true", help="skip points whose run record in OUT is complete for the same config")
    sweep.add_argument("--only", action="append", default=[], metavar="AXIS=VALUE",
                       help="run only matching points, e.g. --only strategy=zero3 --only topology=1x2 (repeatable)")
    sweep.add_argument("--dry-run", action="store_true", help="print every point's commands, run nothing")
    sweep.add_argument("--submit", action="store_true", help="slurm studies: submit each script with sbatch")
    sweep.set_defaults(func=cmd_sweep)

    analyze = sub.add_parser("analyze", parents=[common], help="turn a directory of runs into tables, plots and an HTML report",
                             description="Load every run record under DIR, derive speedup, efficiency, retention, "
                                         "communication overhead and memory per rank, and write CSV and Markdown tables per "
                                         "study, a cross-strategy comparison, PNG plots and one self-contained HTML report.")
    analyze.add_argument("runs", metavar="DIR", help="directory holding run records (searched recursively)")
    analyze.add_argument("--out", metavar="REPORT_DIR", help="where to write the report (default: DIR/report)")
    analyze.set_defaults(func=cmd_analyze)

    paper = sub.add_parser("compare-paper", parents=[common], help="the published study's numbers beside your runs of its setup")
    paper.add_argument("runs", metavar="DIR", help="directory holding run records")
    paper.set_defaults(func=cmd_compare_paper)

    export = sub.add_parser("export", parents=[common], help="consolidate a checkpoint into one plain state dict",
                            description="Merge any strategy's checkpoint (torch, DCP shards, DeepSpeed ZeRO partitions) "
                                        "into one plain state dict plus the model config; start a run from it under any "
                                        "strategy with --set training.init_from=FILE.")
    export.add_argument("checkpoint", help="a checkpoint directory (RUN_DIR/checkpoints/step-NNNNNN) or a run directory "
                                           "(its latest complete checkpoint)")
    export.add_argument("--out", required=True, help="file to write, e.g. model.pt")
    export.set_defaults(func=cmd_export)

    commbench = sub.add_parser("commbench", parents=[common], help="time all-reduce, reduce-scatter and all-gather over message sizes",
                               description="Start the ranks under torchrun and time all-reduce, reduce-scatter and all-gather "
                                           "(and a per-rank host copy) over a sweep of message sizes that includes the zoo's "
                                           "gradient, shard and DDP-bucket sizes: latency, algorithm and bus bandwidth "
                                           "(nccl-tests definitions), and a fit of latency (alpha) and inverse bandwidth (beta) "
                                           "for the link the ranks span. gloo on CPUs, NCCL on GPUs; writes JSON and a Markdown "
                                           "table (docs/projection.md).")
    commbench.add_argument("--nproc-per-node", type=int, default=2, metavar="G", help="ranks per node (default 2)")
    commbench.add_argument("--nnodes", type=int, default=1, metavar="N",
                           help="nodes; with a local --master-addr all N start here, so the ranks talk over an "
                                "inter-node link on 127.0.0.1")
    commbench.add_argument("--node-rank", type=int, default=0, metavar="R",
                           help="this node, when --master-addr is another host (start the command on every node)")
    commbench.add_argument("--master-addr", default="127.0.0.1", metavar="A", help="address of node 0")
    commbench.add_argument("--master-port", type=int, metavar="P", help="rendezvous port (default: a free one here, "
                                                                        "29500 across hosts)")
    commbench.add_argument("--min-bytes", type=int, default=4, help="smallest message (default 4)")
    commbench.add_argument("--max-bytes", type=int, help="largest message (default: the 20M-parameter model's gradients)")
    commbench.add_argument("--iters", type=int, default=20, help="timed iterations per size, fewer above 4 MiB (default 20)")
    commbench.add_argument("--warmup", type=int, default=5, help="warm-up iterations per size (default 5)")
    commbench.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    commbench.add_argument("--oversubscribe", action="store_true", help="allow more ranks than CPU cores on this machine")
    commbench.add_argument("--out", default="runs/commbench.json", help="JSON results; the Markdown table goes next to "
                                                                       "it as .md (default runs/commbench.json)")
    commbench.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # what every rank runs
    commbench.set_defaults(func=cmd_commbench)

    project = sub.add_parser("project", parents=[common], help="projected scaling of every strategy: step time, efficiency, "
                                                               "exposed communication, memory",
                             description="Project, per strategy and rank count, step time, speedup, parallel efficiency, "
                                         "exposed communication and per-rank model-state bytes from a measured compute "
                                         "profile and a network (kanscale commbench results or a cluster file). Everything "
                                         "it prints is a projection, labelled so, with its assumptions (docs/projection.md).")
    project.add_argument("--profile", required=True, metavar="RUNS|BENCH_JSON|paper",
                         help="1-rank run(s) of one experiment (a run directory or a directory of runs), a kanscale bench "
                              "JSON, or paper (the published study's 1-GPU run)")
    project.add_argument("--row", metavar="WORKLOAD/IMPL", help="the row of a bench JSON, e.g. study/fast")
    network = project.add_mutually_exclusive_group(required=True)
    network.add_argument("--network", action="append", metavar="COMMBENCH_JSON",
                         help="kanscale commbench results (repeatable: one intra-node, one inter-node)")
    network.add_argument("--cluster", metavar="YAML", help="a cluster description, e.g. configs/clusters/a100_ib.yaml")
    project.add_argument("--ranks", default="1,2,4,8", help="comma-separated rank counts (default 1,2,4,8)")
    project.add_argument("--ranks-per-node", type=int, metavar="G", help="ranks per node (default: the network's)")
    project.add_argument("--strategies", help="comma-separated (default all: single, ddp, zero1, zero2, zero3, "
                                              "zero3-offload, fsdp1, fsdp2)")
    per_step = project.add_mutually_exclusive_group()
    per_step.add_argument("--micro-batch", type=float, help="samples per rank per step (default: the profile's)")
    per_step.add_argument("--global-batch", type=float, help="samples per step over all ranks, fixed (strong scaling)")
    project.add_argument("--compute-scale", type=float, default=1.0,
                         help="multiply every compute time, e.g. for another device (default 1)")
    project.add_argument("--contention", type=float, default=1.0,
                         help="multiply compute by this when P > 1: ranks slowing each other, e.g. sharing CPU cores "
                              "(default 1)")
    project.add_argument("--forward-fraction", type=float, help="forward's share of the profile's compute "
                                                                "(default: measured by bench, else 1/3)")
    project.add_argument("--probe", action="store_true", help="add the published study's communication probe")
    project.add_argument("--out", help="also write JSON here (and the Markdown next to it as .md)")
    project.set_defaults(func=cmd_project)

    models = sub.add_parser("models", parents=[common], help="list the model zoo's families and their parameter counts")
    models.add_argument("--widths", help="comma-separated widths, e.g. 2,64,1: also count each family's parameters")
    models.set_defaults(func=cmd_models)

    schema = sub.add_parser("schema", parents=[common], help="print the metrics schema (JSON Schema of run and step records)")
    schema.add_argument("--out", help="write to this file instead of stdout")
    schema.set_defaults(func=cmd_schema)

    bench = sub.add_parser("bench", parents=[common], help="time and memory of the zoo's implementations on standard workloads",
                           description="Measure forward, backward and train-step time, samples/s and memory of each "
                                       "implementation in one run on this machine; writes JSON and a Markdown table "
                                       "(see docs/performance.md).")
    bench.add_argument("--models", help="comma-separated workloads: study, wide, tiny (default: study,wide)")
    bench.add_argument("--impl", help="comma-separated implementations: pykan, pykan-lean, reference, fast, rbf, "
                                      "chebyshev, mlp, each optionally with +compile (default: pykan, pykan+compile, "
                                      "reference, reference+compile, fast, fast+compile, rbf, chebyshev, mlp)")
    bench.add_argument("--threads", type=int, default=1, help="intra-op CPU threads (default 1, as in the study)")
    bench.add_argument("--repeats", type=int, help="timed train steps per measurement (default: study 50, wide 5)")
    bench.add_argument("--device", default="auto", help="auto (CUDA if available), cpu or cuda")
    bench.add_argument("--out", default="runs/bench.json", help="JSON results; the Markdown table goes next to it "
                                                               "with .md (default runs/bench.json)")
    bench.set_defaults(func=cmd_bench)
    return parser


def add_experiment_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. --set training.lr=0.01 --set model.widths=[2,32,1] (repeatable)")
    parser.add_argument("--strategy", metavar="PRESET", help="replace the experiment's strategy section with a preset from "
                        "configs/strategies/ (single, ddp, fsdp1, fsdp2, zero0-3, zero3_offload, accelerate, ...) or a YAML file")
    parser.add_argument("--out", help="results directory (overrides output.dir)")


def cmd_train(args: argparse.Namespace) -> int:
    from launchers.summary import format_summary
    from strategies.experiment import load_experiment
    from strategies.loop import train

    overrides = list(args.overrides) + ([f"output.dir={args.out}"] if args.out else [])
    cfg = load_experiment(args.config, overrides, strategy=args.strategy)
    result = train(cfg, show_progress=args.progress, resume=args.resume if args.resume is True else
                   (Path(args.resume) if args.resume else False))
    if result.is_main:
        print(format_summary(result.record, result.run_dir))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from launchers.commands import LaunchSpec
    from launchers.run import RunRequest, execute, plan
    from launchers.slurm import SlurmOptions, submit
    from strategies.experiment import load_experiment

    out = args.out or load_experiment(args.config, args.overrides, strategy=args.strategy).output.dir
    spec = LaunchSpec(launcher=args.launcher, nproc_per_node=args.nproc_per_node, nnodes=args.nnodes,
                      node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
                      rdzv_id=args.rdzv_id, hostfile=args.hostfile, no_ssh=args.no_ssh,
                      accelerate_config=args.accelerate_config)
    request = RunRequest(config=args.config, out=out, spec=spec, overrides=args.overrides, strategy=args.strategy,
                         hosts=[h for h in (args.hosts or "").split(",") if h], oversubscribe=args.oversubscribe,
                         slurm=SlurmOptions(job_name=f"kanscale-{Path(args.config).stem}", inner=args.inner_launcher,
                                            time=args.time, partition=args.partition, account=args.account))
    cfg, request, launch = plan(request)
    if args.dry_run:
        print(launch.render())
        return 0
    if args.launcher == "slurm":
        (script,) = launch.files
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(launch.files[script])
        print(f"wrote {script}", file=sys.stderr)
        print(submit(script) if args.submit else f"submit it with: sbatch {script} (or rerun with --submit)", file=sys.stderr)
        return 0
    return execute(launch)


def cmd_sweep(args: argparse.Namespace) -> int:
    from analysis.load import load_runs
    from analysis.tables import markdown, quick_comparison
    from launchers.sweep import run_sweep

    results = run_sweep(args.study, args.out, resume=args.resume, dry_run=args.dry_run, only=args.only,
                        submit_jobs=args.submit)
    if args.dry_run:
        return 0
    counts = {status: sum(r.status == status for r in results) for status in dict.fromkeys(r.status for r in results)}
    print("\nsweep: " + ", ".join(f"{n} {status}" for status, n in counts.items()))
    for r in results:
        if r.status == "failed":
            print(f"  failed: {r.point}: {r.detail}")
    run_ids = {r.run_id for r in results if r.run_id}
    runs, _ = load_runs(args.out)
    if run_ids and not runs.empty:
        print("\n" + markdown(quick_comparison(runs[runs["run_id"].isin(run_ids)])))
    written = [r for r in results if r.status in ("written", "submitted")]
    if written:
        print(f"\n{len(written)} sbatch script(s) under {Path(args.out) / 'slurm'}" + ("" if args.submit else "; submit each with sbatch, or rerun with --submit"))
    print(f"\nnext: kanscale analyze {args.out}")
    return 1 if counts.get("failed") else 0


def cmd_analyze(args: argparse.Namespace) -> int:
    from analysis.report import analyze

    report = analyze(args.runs, args.out)
    by_name = {t.name: t for t in report.tables}
    if "comparison" in by_name:
        print(by_name["comparison"].markdown())
    for problem in report.problems:
        print(f"not analysed: {problem.message}", file=sys.stderr)
    for _, row in report.unfinished.iterrows():
        print(f"not analysed: {row['run_id']} has status {row['status']}", file=sys.stderr)
    if not by_name:
        print(f"no finished runs under {args.runs}", file=sys.stderr)
    print(f"report: {report.html}")
    return 0


def cmd_compare_paper(args: argparse.Namespace) -> int:
    from analysis.derive import derive
    from analysis.load import load_runs
    from analysis.paper import paper_comparison, probe_costs

    runs, problems = load_runs(args.runs)
    for problem in problems:
        print(f"not analysed: {problem.message}", file=sys.stderr)
    derived = derive(runs) if not runs.empty else runs
    if derived.empty:
        print("no finished runs to compare")
        return 0
    print(paper_comparison(derived).markdown())
    probe = probe_costs(derived)
    if probe is not None:
        print("\n" + probe.markdown())
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from strategies.export import export

    try:
        out, checkpoint = export(args.checkpoint, args.out)
    except FileNotFoundError as err:
        raise ConfigError(f"export: {err}") from None
    print(f"wrote {out}: {checkpoint.meta['strategy']} checkpoint ({checkpoint.meta['format']}, "
          f"{checkpoint.meta['world_size']} ranks) of run {checkpoint.meta['run_id']} at step {checkpoint.step}")
    print(f"start a run from it under any strategy: kanscale train CONFIG --set training.init_from={out}")
    return 0


def cmd_commbench(args: argparse.Namespace) -> int:
    from launchers.commbench import run_commbench
    from strategies.commbench import BenchOptions

    options = BenchOptions(out=args.out, min_bytes=args.min_bytes, max_bytes=args.max_bytes, iters=args.iters,
                           warmup=args.warmup, device=args.device)
    return run_commbench(options, args.nproc_per_node, args.nnodes, args.node_rank, args.master_addr, args.master_port,
                         args.oversubscribe, args.worker)


def cmd_project(args: argparse.Namespace) -> int:
    from launchers.project import ProjectionRequest, run_projection

    fields = {f: getattr(args, f) for f in ProjectionRequest.__dataclass_fields__}
    return run_projection(ProjectionRequest(**fields))


def cmd_models(args: argparse.Namespace) -> int:
    from kan_models import FAMILIES, build_model, count_parameters, parse_model_config

    widths = parse_widths(args.widths) if args.widths else None
    header = f"{'family':<10} {'trainable':>10} {'total':>10}  description" if widths else f"{'family':<10} description"
    print(header)
    for name, cls in FAMILIES.items():
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        if widths:
            count = count_parameters(build_model(parse_model_config({"family": name, "widths": widths}), seed=0))
            print(f"{name:<10} {count.trainable:>10,} {count.total:>10,}  {doc}")
        else:
            print(f"{name:<10} {doc}")
        options = {k: f.default for k, f in cls.model_fields.items() if k not in ("family", "widths")}
        print(f"{'':<10} options: " + ", ".join(f"{k}={v}" for k, v in options.items()))
    if widths:
        print(f"\nwidths {widths}, default options; total counts parameters and buffers (spline grids).")
    return 0


def parse_widths(text: str) -> list[int]:
    try:
        widths = [int(w) for w in text.replace("[", "").replace("]", "").split(",") if w.strip()]
    except ValueError:
        raise ConfigError(f"--widths: expected comma-separated integers like 2,64,1, got {text!r}") from None
    if len(widths) < 2 or any(w <= 0 for w in widths):
        raise ConfigError(f"--widths: need at least two positive widths like 2,64,1, got {text!r}")
    return widths


def cmd_schema(args: argparse.Namespace) -> int:
    from analysis.schema import json_schema

    text = json.dumps(json_schema(), indent=2) + "\n"
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from kan_models import benchmark

    try:
        plan = benchmark.make_plan(args.models, args.impl, args.threads, args.repeats, args.device)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if Path(args.out).suffix == ".md":
        raise ConfigError(f"--out: {args.out} would be overwritten by the Markdown table; give a .json file")
    doc = benchmark.run(plan, progress=lambda line: print(f"[bench] {line}", file=sys.stderr, flush=True))
    table = benchmark.markdown(doc)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    out.with_suffix(".md").write_text(table)
    print(table)
    print(f"wrote {out} and {out.with_suffix('.md')}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    code = run_command(argv)
    from strategies import distributed

    if distributed.joined_process_group:
        # Tearing down a gloo process group can deadlock: its destructor joins worker threads
        # while holding the GIL that a worker needs to free a finished collective's tensors
        # (seen here: a rank that had printed its summary never exited). Everything is written
        # and flushed by now, so the process leaves without running destructors.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def run_command(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from analysis.records import RecordError
    from strategies.failures import Terminated

    try:
        return args.func(args)
    except (ConfigError, RecordError) as err:
        if args.debug:
            raise
        print(f"kanscale: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kanscale: interrupted", file=sys.stderr)
        return 130
    except (Exception, Terminated) as err:  # a run that failed: its record says why; the traceback is for --debug
        if args.debug:
            raise
        print(f"kanscale: {args.command} failed: {type(err).__name__}: {err} (rerun with --debug for the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
