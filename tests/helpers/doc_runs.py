"""How a documented command is run for real here: as written, in a sandbox, made short.

Short means fewer steps, not another command: train and run commands get ``--set`` lines for 3
steps (the last ``--set`` wins, so the command's own settings stay where these do not speak);
a sweep the same through its ``--set``, and one point of its study unless the command picks its
own with ``--only``; benchmarks fewer repeats and smaller messages. A command written for
machines this one is not (more ranks than it has cores, other hosts, SLURM, CUDA) is not run:
:func:`not_here` says why, and the fast tier (tests/test_docs_commands.py) plans it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from launchers.studies.study import axis_label, expand, load_study
from tests.helpers.doc_commands import DocCommand
from tests.helpers.doc_sandbox import placeholders_filled

SHORT = ["--set", "training.steps=3", "--set", "training.warmup_steps=1"]
CHECKPOINTED = ["--set", "training.checkpoint_every=2", "--set", "training.steps=4", "--set", "training.warmup_steps=1"]
# A checkpointed run that a later command of its document resumes is cut short, as that command
# assumes: its process exits at the start of step 3, after the checkpoint of step 2 (fault
# injection is no part of the run's identity, so the resume finds it).
CUT = ["--set", "fault.rank=0", "--set", "fault.step=3", "--set", "fault.kind=exit"]
BENCH = {"--repeats": "1"}
COMMBENCH = {"--iters": "2", "--warmup": "1", "--max-bytes": "65536"}
SCRIPTS = {"bench_timing.py": {"--rounds": "1", "--steps": "3", "--warmup": "1"}}
# Commands written for machines this one is not.
ELSEWHERE = {
    "--hostfile": "its nodes are other hosts reached over ssh (tests/cluster runs this launch against a real sshd "
    "and pdsh)",
    "--hosts": "its nodes are other hosts",
    "--launcher slurm": "it is a SLURM job (tests/cluster runs SLURM launches against a real slurmctld)",
    "--submit": "it submits to a SLURM cluster (tests/cluster)",
    "configs/accelerate/fsdp2.yaml": "Accelerate's FSDP plugin needs CUDA devices",
    "node0.cluster": "its node 0 is another host",
}
# Commands whose cost is minutes here and whose machinery a test of its own runs end to end: the
# fast tier plans each (a study point by point), and these run them.
COVERED = {
    "sweep": "a study: tests/test_sweep.py and tests/test_analysis.py run sweeps and their analysis end to end",
    "bench": "a benchmark: tests/test_bench.py runs kanscale bench",
    "commbench": "a benchmark: tests/test_commbench.py runs kanscale commbench on one node and across two agents",
    "recommend": "a recommendation (probes of every strategy, minutes): tests/test_recommend.py runs kanscale "
    "recommend with a cluster file and with --validate here",
    "option": "one training option under one strategy: the option's own tests train it under every strategy "
    "(tests/test_compile_training.py, test_data_loader.py, test_precision.py)",
    "reads": "it reads what a study or a benchmark wrote (not run here, above)",
    "script": "a benchmark script: tests/test_bench.py, tests/test_measurement_honesty.py and "
    "tests/test_recommend_rehearsed.py run the benchmarks",
}


def not_run(command: DocCommand) -> str | None:
    """Why the slow tier does not run the command, or None."""
    words = list(command.argv)
    text = " ".join(words)
    reason = next((why for marker, why in ELSEWHERE.items() if marker in text), None)
    if reason:
        return reason
    ranks = int(
        _value(words, "--nproc-per-node") or _value(words, "--nproc_per_node") or _value(words, "--num_gpus") or 1
    )
    if ranks > 2:
        return f"it starts {ranks} ranks per node, written for a GPU node (this machine has {os.cpu_count()} cores)"
    if command.program == "make":
        return dict.fromkeys(("check", "test", "test-slow", "test-both", "test-cluster"), ".ci/run runs it").get(
            command.argv[1],
            "minutes of training: the fast tier plans make demo's "
            "sweep point by point; tests/test_sweep.py runs sweeps",
        )
    if command.program == "pip":
        return "make install installs the dev extras, and the fast tier checks that they hold what it installs"
    return COVERED.get(_kind(command))


def _kind(command: DocCommand) -> str | None:
    words, sub = list(command.argv), command.subcommand
    if sub in ("sweep", "bench", "commbench", "recommend"):
        return sub
    if command.program in ("python", "torchrun") and any(w.endswith(".py") for w in words[:3]):
        return "script"
    sets = [words[n + 1] for n, w in enumerate(words[:-1]) if w == "--set"]
    if sub == "run" and sets and all(s.startswith("training.") for s in sets):
        return "option"
    if sub in ("analyze", "compare-paper", "project") and any(w.startswith("runs/") for w in words):
        return "reads"
    return None


def resumed_later(command: DocCommand, later: list[DocCommand]) -> bool:
    """Whether a later command resumes this one's run (its words with ``--resume`` added)."""
    return "--resume" not in command.argv and any(
        "--resume" in c.argv and [w for w in c.argv if w != "--resume"] == list(command.argv) for c in later
    )


def short(command: DocCommand, sandbox: Path, cut: bool = False) -> list[str]:
    """The command's words, made short as the module says (``cut``: and cut short)."""
    words = placeholders_filled(command.argv, sandbox)
    words[0] = _program(words[0])
    kind = command.subcommand
    if kind in ("train", "run"):
        words += (CHECKPOINTED if any("checkpoint_every" in w for w in words) else SHORT) + (CUT if cut else [])
    elif kind == "sweep":
        words += SHORT + ([] if "--only" in words or "--dry-run" in words else _first_point(words, sandbox))
    elif kind == "bench":
        words = _with(words, BENCH)
    elif kind == "commbench":
        words = _with(words, COMMBENCH)
    elif command.program in ("python", "torchrun") and any(w.endswith(".py") for w in words):
        script = next(w for w in words if w.endswith(".py"))
        words = _with(words, SCRIPTS.get(Path(script).name, {}))
    return words


def run(command: DocCommand, sandbox: Path, cut: bool = False, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        **command.env,
        "KANSCALE_CACHE_DIR": str(sandbox / ".cache"),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    words = short(command, sandbox, cut)
    return subprocess.run(
        words, cwd=sandbox, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


def _program(word: str) -> str:
    """``python`` is this test's interpreter; the suite's programs are its virtual environment's."""
    if word == "python":
        return sys.executable
    local = Path(sys.executable).parent / Path(word).name
    return str(local) if local.exists() else word


def _first_point(words: list[str], sandbox: Path) -> list[str]:
    """``--only`` lines that pick the study's first point (a one-process one where it has one)."""
    study = load_study(sandbox / words[2] if (sandbox / words[2]).exists() else words[2])
    points, _ = expand(study)
    point = min(points, key=lambda p: p.world_size)
    return [w for axis, value in point.axes.items() for w in ("--only", f"{axis}={axis_label(value)}")]


def _value(words: list[str], option: str) -> str | None:
    for n, word in enumerate(words):
        if word == option and n + 1 < len(words):
            return words[n + 1]
        if word.startswith(option + "="):
            return word.split("=", 1)[1]
    return None


def _with(words: list[str], settings: dict[str, str]) -> list[str]:
    """``words`` with each option of ``settings`` set to its value (replaced where given)."""
    words = list(words)
    for option, value in settings.items():
        if option in words:
            words[words.index(option) + 1] = value
        else:
            words += [option, value]
    return words
