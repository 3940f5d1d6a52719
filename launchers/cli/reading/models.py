"""``kanscale models``."""

from __future__ import annotations

import argparse

from kanscale.errors import ConfigError
from launchers.cli.common import common_options


def register(subcommands: argparse._SubParsersAction) -> None:
    models = subcommands.add_parser(
        "models", parents=[common_options()], help="list the model zoo's families and their parameter counts"
    )
    models.add_argument("--widths", help="comma-separated widths, e.g. 2,64,1: also count each family's parameters")
    models.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
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
    print(f"{'custom':<10} {'':>22}  " if widths else f"{'custom':<10} ", end="")
    print(
        "your own nn.Module: model.factory 'package.module:function' or 'file.py:function', model.options "
        "(docs/models.md)"
    )
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
