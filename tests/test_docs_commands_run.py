"""Every documented command this machine can run, run for real: each document's commands in
the order it shows them, in one sandbox per document (so ``kanscale analyze runs/compile`` reads
what the sweep before it wrote, and ``kanscale export runs/<run_id>`` what the training before
it checkpointed), made short as tests/helpers/doc_runs.py says. The fast tier
(tests/test_docs_commands.py) plans every command, these included, and checks the documented
errors.
"""

from __future__ import annotations

import time

import pytest

from analysis.records.run_files import read_summary
from tests.helpers.doc_commands import DOCUMENTS, ROOT, DocCommand, documented_commands
from tests.helpers.doc_runs import not_run, resumed_later, run, short
from tests.helpers.doc_sandbox import make_sandbox, newest_run

pytestmark = pytest.mark.slow

# What a document's commands take that no command of it writes: the runs it says were made
# first, made here (short) before the first command that reads them.
MADE_FIRST = {
    "runs/projval-1M": [
        "kanscale",
        "sweep",
        "projval.yaml",
        "--out",
        "runs/projval-1M",
        "--only",
        "size=1M",
        "--only",
        "topology=1x1",
    ],
}


def first_shown(command: DocCommand) -> bool:
    """Whether this is the first document to show the command (a command shown twice runs once)."""
    return next(c for c in ALL if c.argv == command.argv).where == command.where


ALL = documented_commands()


@pytest.mark.parametrize(
    "document", [d for d in DOCUMENTS if documented_commands([d])], ids=lambda d: str(d.relative_to(ROOT))
)
def test_every_command_of_the_document_runs(document, tmp_path):
    sandbox = make_sandbox(tmp_path)
    failures, ran, left = [], [], []
    commands = documented_commands([document])
    for n, command in enumerate(commands):
        if command.output or command.synopsis or not first_shown(command):  # tests/test_docs_commands.py checks
            continue  # these; a repeat runs once
        why = not_run(command)
        if why:
            left.append(f"{command.where}: {why}")
            continue
        for needed, maker in MADE_FIRST.items():
            if needed in command.argv and not (sandbox / needed).exists():
                made = run(command.__class__(where="made first", text="", argv=tuple(maker)), sandbox)
                assert made.returncode == 0, made.stderr[-3000:]
        started, cut = time.monotonic(), resumed_later(command, commands[n + 1 :])
        done = run(command, sandbox, cut)
        ran.append(f"{command.where} ({time.monotonic() - started:.0f} s)")
        if cut:
            record = read_summary(newest_run(sandbox))
            assert done.returncode != 0 and record.status == "incomplete", done.stderr[-2000:]  # as a crash leaves it
        elif done.returncode != 0:
            failures.append(
                f"{command.where}: {' '.join(short(command, sandbox))}\n  exit {done.returncode}: "
                f"{(done.stderr or done.stdout)[-1500:]}"
            )
    print(f"{document.name}: ran {ran}; not run: {left}")
    assert not failures, "\n\n".join(failures)
