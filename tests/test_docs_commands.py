"""Every shell command README.md and docs/*.md show is exercised here, so a documented command
cannot silently stop working (the README's chebyshev example once failed as written).

This tier, in seconds: every command's words parse with the suite's own parser, every file it
names exists, every option a synopsis line shows exists, every ``train``/``run``/``sweep``
plans on a dry run (its config validated, checked against the launch, its commands printed),
and every documented error prints what the docs say it prints. tests/test_docs_commands_run.py
(the slow tier) runs them for real with short step counts where this machine can.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
from pathlib import Path

import pytest

from launchers.cli import build_parser, main
from tests.helpers.doc_commands import ROOT, DocCommand, documented_commands
from tests.helpers.doc_sandbox import kanscale_words, make_sandbox, placeholders_filled

COMMANDS = documented_commands()
REPO_PATH = re.compile(r"^(configs|examples|scripts)/")


def distinct(commands: list[DocCommand]) -> list[DocCommand]:
    """One of each command (the same command shown in several documents is checked once)."""
    return list({(c.argv, tuple(c.env.items())): c for c in commands}.values())


CONCRETE = [c for c in distinct(COMMANDS) if not c.synopsis]
KANSCALE = [c for c in CONCRETE if c.subcommand is not None]


def ids(command: DocCommand) -> str:
    return f"{command.where} {' '.join(command.argv[1:])[:60]}"


def subcommand_parser(name: str) -> argparse.ArgumentParser:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def test_the_docs_show_commands_of_every_kind_the_suite_has():
    programs = {c.program for c in COMMANDS}
    assert programs <= {"kanscale", "torchrun", "accelerate", "deepspeed", "make", "python", "pip"}, programs
    shown = {c.subcommand for c in KANSCALE}
    assert {"train", "run", "sweep", "analyze", "export", "bench", "commbench", "project"} <= shown, shown
    assert len(CONCRETE) > 60  # the reader above found the blocks (a broken reader finds none)


@pytest.mark.parametrize("command", [c for c in distinct(COMMANDS) if c.synopsis and c.program == "kanscale"], ids=ids)
def test_every_option_a_synopsis_shows_exists(command):
    parser = build_parser() if command.subcommand is None else subcommand_parser(command.subcommand)
    known = set(parser._option_string_actions)
    shown = {w.split("=")[0].strip("[]") for w in command.argv if w.lstrip("[").startswith("--")}
    assert shown - {"--help"} <= known, (
        f"{command.where}: {sorted(shown - known)} are not options of {command.subcommand}"
    )


@pytest.mark.parametrize("command", CONCRETE, ids=ids)
def test_every_command_parses_and_names_files_that_exist(command):
    words = placeholders_filled(command.argv, ROOT)
    missing = [w for w in words if REPO_PATH.match(w) and not (ROOT / w.split(":")[0]).exists()]
    assert not missing, f"{command.where}: {missing} do not exist"
    if command.subcommand is not None:
        try:
            build_parser().parse_args(kanscale_words(words))
        except SystemExit as err:
            pytest.fail(f"{command.where}: {command.text!r} does not parse (exit {err.code})")
    elif command.program == "pip":
        extras = (ROOT / "pyproject.toml").read_text()
        assert all(f'"{name}' in extras for name in words[2:]), f"{command.where}: pyproject.toml installs {words[2:]}"
    elif command.program == "python" and words[1] == "-c":
        compile(words[2], command.where, "exec")  # the slow tier runs it
    elif command.program == "python" or command.program == "torchrun":
        script = next(w for w in words if w.endswith(".py"))
        given = {w.split("=")[0] for w in words if w.startswith("--") and words.index(w) > words.index(script)}
        source = (ROOT / script).read_text()  # its argparse options, read rather than run (torch imports take seconds)
        assert all(f'"{option}"' in source for option in given), f"{command.where}: {script} has no {given}"
    else:
        assert command.program == "make" and make_recipe(command.argv[1]), f"{command.where}: no make target"
        for line in make_recipe(command.argv[1]):
            if line[0] == "kanscale":
                build_parser().parse_args(line[1:])


def make_recipe(target: str) -> list[list[str]]:
    """The commands of a Makefile target, those of the targets it names first (``check: lint
    types``), the virtual environment's programs by their names."""
    text = (ROOT / "Makefile").read_text()
    found = re.search(rf"^{re.escape(target)}:(.*)\n((?:\t.*\n)*)", text, re.M)
    if not found:
        return []
    first = [line for name in found.group(1).split() if not name.startswith("$") for line in make_recipe(name)]
    return first + [shlex.split(line.strip().replace("$(BIN)/", "")) for line in found.group(2).splitlines()]


def test_make_test_runs_in_ci_and_make_demo_plans(sandbox, monkeypatch):
    """``make test`` is what .ci/run runs first; ``make demo``'s comparison is a sweep (minutes of
    training), planned here point by point as every documented sweep is."""
    assert "make test" in (ROOT / ".ci/run").read_text()
    sweeps = [line for line in make_recipe("demo") if line[:2] == ["kanscale", "sweep"]]
    assert sweeps, "make demo runs a sweep"
    monkeypatch.chdir(sandbox)
    with contextlib.redirect_stdout(io.StringIO()) as printed, contextlib.redirect_stderr(io.StringIO()):
        assert main([*sweeps[0][1:], "--dry-run"]) == 0
    assert printed.getvalue().count("launchers.cli train") >= 10  # every point of the comparison


def dry_run_words(command: DocCommand) -> list[str]:
    """The command as a dry run: ``train`` through ``run --launcher none`` (the same config
    checks, no process started), more ranks than this machine's cores allowed (the command is
    written for a GPU node: the plan, not the timing, is what is checked here)."""
    words = kanscale_words(placeholders_filled(command.argv, Path.cwd()))
    if words[0] == "train":
        words = ["run", *[w for w in words[1:] if w not in ("--resume",)], "--launcher", "none"]
    if "--dry-run" not in words:
        words.append("--dry-run")
    if "--oversubscribe" not in words:
        words.append("--oversubscribe")
    return words


PLANNED = [c for c in KANSCALE if c.subcommand in ("train", "run", "sweep") and not c.output]
# Commands written for machines this one is not (GPU nodes, a SLURM or ssh cluster): refused
# before launch here for one of the reasons this machine can give (a tool missing, or present
# but with no cluster behind it: CI's machine may have pdsh and slurm-wlm installed by the
# cluster tier), and no other, unless this machine has what they need.
OTHER_MACHINES = {
    "configs/accelerate/fsdp2.yaml": ("accelerate + FSDP needs CUDA devices here",),
    "--hostfile hosts.txt": ("pdsh, which is not installed here", "--ssh-key: ", "ssh cannot reach"),
    "--launcher slurm --nnodes 4 --nproc-per-node 2 --time": ("sinfo is not on this machine", "but sinfo failed"),
}
# Commands that take what an earlier one in the same document wrote: the slow tier runs them in
# order (tests/test_docs_commands_run.py).
AFTER_AN_EARLIER_COMMAND = ("training.init_from=model.pt",)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    return make_sandbox(tmp_path_factory.mktemp("docs"))


@pytest.mark.parametrize("command", PLANNED, ids=ids)
def test_every_documented_run_plans(command, sandbox, monkeypatch):
    if any(needs in command.text for needs in AFTER_AN_EARLIER_COMMAND):
        pytest.skip("it takes what an earlier documented command writes: the slow tier runs it after that one")
    monkeypatch.chdir(sandbox)
    printed, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        code = main(dry_run_words(command))
    elsewhere = [why for written_for, why in OTHER_MACHINES.items() if written_for in " ".join(command.argv)]
    if elsewhere and code != 0:
        assert code == 2 and any(why in errors.getvalue() for why in elsewhere[0]), errors.getvalue()
        return
    assert code == 0, f"{command.where}: {command.text}\n{errors.getvalue()[-2000:]}"
    assert printed.getvalue().strip(), "a dry run prints the commands it would run"


def normalised(text: str) -> str:
    """Output with the machine's CPU name left out (the docs show the one they were written on)."""
    return re.sub(r"this CPU \([^)]*\)", "this CPU (...)", text)


def lines_not_printed(command: DocCommand, printed: str) -> list[str]:
    """The documented output lines the command did not print (``...`` stands for the rest)."""
    printed = normalised(printed)
    return [
        line
        for line in command.output
        if not re.search(re.escape(normalised(line)).replace(re.escape("..."), ".*"), printed)
    ]


@pytest.mark.parametrize("command", [c for c in KANSCALE if c.output], ids=ids)
def test_a_documented_error_prints_what_the_docs_show(command, sandbox, monkeypatch):
    monkeypatch.chdir(sandbox)
    words = kanscale_words(placeholders_filled(command.argv, sandbox))
    if words[0] == "run":
        words.append("--dry-run")  # the documented refusal comes before launch; nothing need start
    errors = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(errors):
        code = main(words)
    if "training.precision=fp16" in command.text and code == 0:
        pytest.skip("this CPU has oneDNN fp16 kernels: the documented refusal is for a CPU without them")
    assert code == 2, errors.getvalue()
    assert not lines_not_printed(command, errors.getvalue()), (
        f"{command.where} shows lines the command does not print: {lines_not_printed(command, errors.getvalue())}\n"
        f"it prints:\n{errors.getvalue()}"
    )


def test_the_reader_sees_continued_lines_chains_and_output(tmp_path):
    """The reader's rules on a document written for the purpose: a backslash continues a
    command, ``&&`` chains two, a prompted block's other lines are its output, a file tree is
    no command."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "```bash\nkanscale train quickstart \\\n    --set training.steps=3   # short\n"
        "kanscale sweep s.yaml --out r && kanscale analyze r\n```\n\n```\n$ kanscale train x\n"
        "kanscale: error: x is invalid\n```\n\n```\nkanscale/   the ground floor\n```\n"
    )
    found = documented_commands([doc])
    assert [c.argv for c in found] == [
        ("kanscale", "train", "quickstart", "--set", "training.steps=3"),
        ("kanscale", "sweep", "s.yaml", "--out", "r"),
        ("kanscale", "analyze", "r"),
        ("kanscale", "train", "x"),
    ]
    assert found[-1].output == ("kanscale: error: x is invalid",)
    assert os.path.basename(found[0].where.split(":")[0]) == "doc.md"


LAUNCH_LINES = [c for c in CONCRETE if c.program == "accelerate"]


@pytest.mark.parametrize("command", LAUNCH_LINES, ids=ids)
def test_every_accelerate_launch_line_passes_accelerates_own_checks(command, monkeypatch):
    """accelerate launch checks its config file against the command before it starts anything:
    the documented lines once stopped there (no process count in the shipped configs, none given)
    while their kanscale part parsed. This runs accelerate's own check on each line as printed."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    monkeypatch.chdir(ROOT)
    words = placeholders_filled(command.argv, ROOT)
    args = launch_command_parser().parse_args(words[2:])
    try:
        _validate_launch_command(args)
    except ValueError as err:
        pytest.fail(f"{command.where}: accelerate launch refuses {command.text!r}: {err}")
