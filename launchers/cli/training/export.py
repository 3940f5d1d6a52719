"""``kanscale export``."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from kanscale.directories import check_output_dir
from kanscale.errors import ConfigError
from launchers.cli.common import common_options


def register(subcommands: argparse._SubParsersAction) -> None:
    export = subcommands.add_parser(
        "export",
        parents=[common_options()],
        help="consolidate a checkpoint into one plain state dict",
        description="Merge any strategy's checkpoint (torch, DCP shards, DeepSpeed ZeRO partitions) "
        "into one plain state dict plus the model config; start a run from it under any "
        "strategy with --set training.init_from=FILE.",
    )
    export.add_argument(
        "checkpoint",
        help="a run directory (its newest checkpoint that verifies; newer ones that do "
        "not are named on stderr and skipped) or one checkpoint directory "
        "(RUN_DIR/checkpoints/step-NNNNNN, refused unless it verifies)",
    )
    export.add_argument(
        "--out",
        required=True,
        help="file to write, e.g. model.pt, outside the run directory it reads (replaced as a whole once complete)",
    )
    export.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from strategies.lifecycle.export import export

    # before anything is loaded: torch.save would replace nothing and fail on a directory
    if Path(args.out).is_dir():
        raise ConfigError(
            f"--out: {args.out} is a directory; give the file to write, e.g. {Path(args.out) / 'model.pt'}"
        )
    check_output_dir(Path(args.out).parent, "--out", "to write the model file in")

    try:
        out, checkpoint = export(args.checkpoint, args.out)
    except FileNotFoundError as err:
        raise ConfigError(f"export: {err}") from None
    print(
        f"wrote {out}: {checkpoint.meta['strategy']} checkpoint ({checkpoint.meta['format']}, "
        f"{checkpoint.meta['world_size']} ranks) of run {checkpoint.meta['run_id']} at step {checkpoint.step}"
    )
    init = shlex.quote(f"training.init_from={out}")
    print(f"start a run from it under any strategy: kanscale train CONFIG --set {init}")
    return 0
