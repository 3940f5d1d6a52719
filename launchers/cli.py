"""``kanscale``: train one experiment, list the model zoo, print the metrics schema."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EPILOG = """examples:
  kanscale train configs/experiments/quickstart.yaml
  kanscale train configs/experiments/paper_kan64.yaml --set training.epochs=1 --out runs/paper
  torchrun --standalone --nproc_per_node 2 -m launchers.cli train configs/experiments/quickstart.yaml --strategy fsdp2
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
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config field, e.g. --set training.lr=0.01 --set model.widths=[2,32,1] (repeatable)")
    train.add_argument("--strategy", metavar="PRESET", help="replace the experiment's strategy section with a preset from "
                       "configs/strategies/ (single, ddp, fsdp1, fsdp2, zero0-3, zero3_offload, accelerate, ...) or a YAML file")
    train.add_argument("--out", help="results directory (overrides output.dir)")
    bar = train.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None, help="always show a progress bar")
    bar.add_argument("--no-progress", dest="progress", action="store_false", help="log lines instead of a progress bar")
    train.set_defaults(func=cmd_train)

    models = sub.add_parser("models", parents=[common], help="list the model zoo's families and their parameter counts")
    models.add_argument("--widths", help="comma-separated widths, e.g. 2,64,1: also count each family's parameters")
    models.set_defaults(func=cmd_models)

    schema = sub.add_parser("schema", parents=[common], help="print the metrics schema (JSON Schema of run and step records)")
    schema.add_argument("--out", help="write to this file instead of stdout")
    schema.set_defaults(func=cmd_schema)
    return parser


def cmd_train(args: argparse.Namespace) -> int:
    from launchers.summary import format_summary
    from strategies.experiment import load_experiment
    from strategies.loop import train

    overrides = list(args.overrides) + ([f"output.dir={args.out}"] if args.out else [])
    cfg = load_experiment(args.config, overrides, strategy=args.strategy)
    result = train(cfg, show_progress=args.progress)
    if result.is_main:
        print(format_summary(result.record, result.run_dir))
    return 0


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
    from strategies.config import ConfigError

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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from analysis.records import RecordError
    from strategies.config import ConfigError

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


if __name__ == "__main__":
    sys.exit(main())
