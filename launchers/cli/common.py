"""What several subcommands share: the options every subcommand takes, the experiment options,
how an error becomes a message and an exit code, and how a rank of a launch leaves."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from kanscale import log
from kanscale.errors import ConfigError
from kanscale.files import bounded, check_typed_path

logger = log.get(__name__)


def common_options() -> argparse.ArgumentParser:
    """Options every subcommand accepts after its name. SUPPRESS keeps a subcommand from
    resetting what was given before it (``kanscale --debug train ...``)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show Python tracebacks on errors"
    )
    add_verbosity_options(common, default=argparse.SUPPRESS)
    return common


def add_verbosity_options(parser: argparse.ArgumentParser, default: object) -> None:
    """``-q``/``-v``: how much the suite says on stderr (``verbosity``: -1, 1; ``default`` when
    neither is given), in this process and in every rank it starts."""
    verbosity = parser.add_mutually_exclusive_group()
    verbosity.add_argument(
        "-q",
        "--quiet",
        dest="verbosity",
        action="store_const",
        const=-1,
        default=default,
        help="say only warnings and errors on stderr: no progress lines (results on stdout stay), "
        "here and in every rank started",
    )
    verbosity.add_argument(
        "-v",
        "--verbose",
        dest="verbosity",
        action="store_const",
        const=1,
        default=default,
        help="say debug messages on stderr too, such as the commands a launch starts",
    )


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number no smaller than ``minimum`` (ranks, nodes, a node's
    rank), refused by argparse with the option's name rather than after the launcher starts."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}; give a whole number of at least {minimum}")
        return value

    return parse


PORTS = range(1, 65536)


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 1-65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (1-65535)") from None
    if value not in PORTS:
        raise argparse.ArgumentTypeError(f"{value} is not a port number; give one from 1 to 65535")
    return value


def add_experiment_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set training.lr=0.01 --set model.widths=[2,32,1] (repeatable)",
    )
    parser.add_argument(
        "--strategy",
        metavar="PRESET",
        help="replace the experiment's strategy section with a preset from configs/strategies/ "
        "(single, ddp, fsdp1, fsdp2, zero0-3, zero3_offload, accelerate, tp, fsdp2_tp, ...) or a YAML file",
    )
    parser.add_argument(
        "--deepspeed-config",
        "--deepspeed_config",
        dest="deepspeed_config",
        metavar="FILE",
        help="train with DeepSpeed from this native DeepSpeed JSON (replaces the strategy section; "
        "the experiment still owns batch sizes, clipping and precision)",
    )
    parser.add_argument("--out", help="results directory (overrides output.dir)")


def experiment_overrides(args: argparse.Namespace) -> list[str]:
    """The ``--set`` overrides, with ``--deepspeed-config`` as the strategy section it stands for
    (carried to every rank as an override, like any other)."""
    if args.deepspeed_config is None:
        return list(args.overrides)
    if args.strategy is not None:
        raise ConfigError(
            "--deepspeed-config replaces the strategy section, so it cannot be combined with --strategy; "
            "drop one (a DeepSpeed preset names its JSON in its config key)"
        )
    from strategies.backends.deepspeed import native_file_section

    return [f"strategy={json.dumps(native_file_section(args.deepspeed_config))}", *args.overrides]


def exit_code(err: BaseException, args: argparse.Namespace) -> int:
    """Print what went wrong in one line (re-raise under --debug) and return the exit code:
    2 for input the suite refuses, 130 for Ctrl-C, 1 for a run that failed."""
    from analysis.records.run_files import RecordError

    if isinstance(err, KeyboardInterrupt):
        logger.error("kanscale: interrupted")
        return 130
    typed = getattr(args, "typed", sys.argv[1:])
    if not args.debug and isinstance(err, (ConfigError, RecordError)):
        logger.error(bounded(f"kanscale: error: {err}", typed))
        return 2
    # imported only here: it imports torch, seconds a refused input need not wait
    from strategies.lifecycle.disk import disk_full
    from strategies.lifecycle.failures import Terminated

    if args.debug or not isinstance(err, (Exception, Terminated)):
        raise err
    # a write that found the disk full where no file was named (this process's own output to a
    # log on that disk) says so, as every named write does
    err = disk_full(err, Path(getattr(args, "out", None) or "."), "this command's output under")
    # A run that failed: its record says why; the traceback is for --debug.
    logger.error(
        bounded(
            f"kanscale: {args.command} failed: {type(err).__name__}: {err} (rerun with --debug for the traceback)",
            typed,
        )
    )
    return 1


def exit_without_teardown(code: int) -> NoReturn:
    """Leave a process that joined a gloo process group without running destructors. Tearing
    the group down can deadlock: its destructor joins worker threads while holding the GIL that
    a worker needs to free a finished collective's tensors (seen here: a rank that had printed
    its summary never exited). Everything is written and flushed by the time this is called."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_rank(env: Any, args: argparse.Namespace, work: Callable[[], int]) -> int:
    """Run one rank's ``work`` (``env`` a strategies.runtime.distributed.DistEnv) and return its exit
    code. Once the rank has joined a process group, an error becomes a message and a code
    (exit_code) and the process leaves through exit_without_teardown; before that, errors go on
    to the caller."""
    try:
        code = work()
    except BaseException as err:
        if not env.joined_process_group:
            raise
        code = exit_code(err, args)
    if env.joined_process_group:
        exit_without_teardown(code)
    return code


# Every argument that names a file or a folder, by its dest: each is taken as typed, and refused
# before anything runs where it could not be (kanscale.files.check_typed_path).
PATH_ARGUMENTS = (
    "config",
    "study",
    "runs",
    "checkpoint",
    "out",
    "json",
    "hostfile",
    "cluster",
    "network",
    "deepspeed_config",
    "accelerate_config",
    "resume",
    "profile",
)
POSITIONAL = {"config", "study", "runs", "checkpoint"}


def check_paths(args: argparse.Namespace) -> None:
    """Refuse, naming the flag, a path argument no file system or reader could take as typed."""
    for dest in PATH_ARGUMENTS:
        value = getattr(args, dest, None)
        for text in value if isinstance(value, list) else [value]:
            if isinstance(text, str):
                check_typed_path(text, dest if dest in POSITIONAL else f"--{dest.replace('_', '-')}")


class Parser(argparse.ArgumentParser):
    """argparse's parser, but its refusals (an invalid choice, a bad number) repeat no more than a
    few hundred characters of what was typed."""

    def error(self, message: str) -> NoReturn:
        super().error(bounded(message, ()))
