"""``kanscale schema``."""

from __future__ import annotations

import argparse
import json
import sys

from analysis.records.schema import FROZEN_SCHEMAS, SCHEMA_VERSION
from kanscale import log
from kanscale.writes import atomic_write_text
from launchers.cli.common import common_options

logger = log.get(__name__)


def register(subcommands: argparse._SubParsersAction) -> None:
    schema = subcommands.add_parser(
        "schema", parents=[common_options()], help="print the metrics schema (JSON Schema of run and step records)"
    )
    schema.add_argument("--out", help="write to this file instead of stdout")
    schema.add_argument(
        "--schema-version",
        type=int,
        choices=[*FROZEN_SCHEMAS, SCHEMA_VERSION],
        default=SCHEMA_VERSION,
        help=f"{SCHEMA_VERSION} (default, what runs write), or {' or '.join(map(str, FROZEN_SCHEMAS))} "
        f"(older records, migrated to {SCHEMA_VERSION} when read)",
    )
    schema.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from analysis.records.schema import json_schema

    text = json.dumps(json_schema(args.schema_version), indent=2) + "\n"
    if args.out:
        atomic_write_text(args.out, text)
        logger.info(f"wrote {args.out}")
    else:
        sys.stdout.write(text)
    return 0
