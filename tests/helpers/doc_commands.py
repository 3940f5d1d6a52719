"""The shell commands README.md, CONTRIBUTING.md and docs/*.md show, read out of their fenced
code blocks.

A command is a line of a ``bash``/``sh`` block (but a comment), or a line of an unlabelled block
that starts with a program the suite documents (an unlabelled block may also hold a file tree or
a data-flow sketch, which are not commands). A line ending in a backslash continues on the next.
In a console block, and wherever a line starts with ``$ ``, only such lines are commands and the
lines after one, up to the next command, are the output the docs promise it prints.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
PROGRAMS = ("kanscale", "torchrun", "accelerate", "deepspeed", "make", "python", "pip")
SUBCOMMANDS = (
    "train",
    "run",
    "sweep",
    "analyze",
    "compare-paper",
    "export",
    "bench",
    "commbench",
    "project",
    "models",
    "schema",
)
SHELL_BLOCKS = ("bash", "sh", "shell", "console")
FENCE = re.compile(r"^```(\w*)\s*$")
# a word of a synopsis line: a placeholder (CONFIG, STUDY.yaml), an optional part, a choice
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*(\.\w+)?$|^\[|^[\w-]+(\|[\w-]+)+\]?$|^\.\.\.$|^/$")


@dataclass(frozen=True)
class DocCommand:
    """One documented command: where it is, its text as shown, and its words as a shell splits
    them (comments dropped; ``VAR=value`` prefixes in ``env``)."""

    where: str
    text: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    output: tuple[str, ...] = ()  # what the docs show it printing (console blocks)

    @property
    def synopsis(self) -> bool:
        """A usage line (``kanscale train CONFIG [--set ...]``), not a command to run."""
        values = {n + 1 for n, word in enumerate(self.argv) if word == "--set"}  # a value may hold [ ] |
        return any(PLACEHOLDER.search(word) for n, word in enumerate(self.argv) if n not in values)

    @property
    def program(self) -> str:
        return Path(self.argv[0]).name if self.argv else ""

    @property
    def subcommand(self) -> str | None:
        """The kanscale subcommand (``train``, ``run``, ...), also under ``-m launchers.cli``."""
        words = list(self.argv)
        if self.program == "kanscale":
            return words[1] if len(words) > 1 and not words[1].startswith("-") else None
        if "launchers.cli" in words:
            rest = words[words.index("launchers.cli") + 1 :]
            return rest[0] if rest else None
        return None


def documented_commands(documents: list[Path] = DOCUMENTS) -> list[DocCommand]:
    return [command for document in documents for command in _commands_of(document)]


def _commands_of(document: Path) -> list[DocCommand]:
    commands: list[DocCommand] = []
    name = document.relative_to(ROOT) if document.is_relative_to(ROOT) else document.name
    for first_line, language, lines in _blocks(document.read_text().splitlines()):
        if language and language not in SHELL_BLOCKS:
            continue
        prompted = language == "console" or any(line.startswith("$ ") for line in lines)
        text, start, output = "", 0, []
        for number, line in enumerate(lines, first_line):
            if text.endswith("\\") or (text and line.startswith("[")):  # a synopsis may go on, indented
                text = text.removesuffix("\\") + " " + line
                continue
            if line.startswith("$ ") or (
                not prompted and ((language in SHELL_BLOCKS and line and not line.startswith("#")) or _is_command(line))
            ):
                if text:
                    commands += _commands(f"{name}:{start}", text, output)
                text, start, output = line.removeprefix("$ "), number, []
            elif text and prompted and line:
                output.append(line)
            elif text and ((line and not line.startswith("#")) or not prompted):
                commands += _commands(f"{name}:{start}", text, output)
                text, output = "", []
        if text:
            commands += _commands(f"{name}:{start}", text, output)
    return commands


def _blocks(lines: list[str]) -> list[tuple[int, str, list[str]]]:
    """Each fenced block: the number of its first line, its language ("" unlabelled), its lines
    (stripped)."""
    blocks, opened = [], None
    for number, line in enumerate(lines, 1):
        fence = FENCE.match(line.strip())
        if fence and opened is None:
            opened = (number + 1, fence.group(1), [])
        elif fence:
            blocks.append(opened)
            opened = None
        elif opened is not None:
            opened[2].append(line.strip())
    return blocks


def _is_command(line: str) -> bool:
    """Whether an unprompted line starts a command: a program the suite documents (and for
    kanscale, one of its subcommands or options), not a file tree's ``kanscale/`` or a sketch."""
    words = line.split()
    if not words or words[0].endswith("/") or Path(words[0]).name not in PROGRAMS:
        return False
    return Path(words[0]).name != "kanscale" or (
        len(words) > 1 and (words[1] in SUBCOMMANDS or words[1].startswith("-"))
    )


def _commands(where: str, text: str, output: list[str]) -> list[DocCommand]:
    """The commands of one line: a chain joined by ``&&`` is each of its commands in turn."""
    words = shlex.split(text, comments=True)
    chain, current = [], []
    for word in [*words, "&&"]:
        if word == "&&":
            chain.append(current)
            current = []
        else:
            current.append(word)
    commands = []
    for argv in chain:
        env = {}
        while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
            name, _, value = argv.pop(0).partition("=")
            env[name] = value
        commands.append(DocCommand(where=where, text=text, argv=tuple(argv), env=env, output=tuple(output)))
    return commands
