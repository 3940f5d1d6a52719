"""A directory to run documented commands in, as a user runs them from a clone: the repository's
configs/, examples/ and scripts/ beside the files the docs assume the user has made (a CSV of
their own, a DeepSpeed JSON, a hostfile, the study file docs/projection.md shows)."""

from __future__ import annotations

import importlib.resources
import re
from pathlib import Path

import numpy as np

from tests.helpers.doc_commands import ROOT

LINKED = ("configs", "examples", "scripts", ".venv")


def make_sandbox(where: Path) -> Path:
    for name in LINKED:
        if (ROOT / name).exists() and not (where / name).exists():
            (where / name).symlink_to(ROOT / name)
    _houses_csv(where / "data/houses.csv")
    (where / "my_zero3.json").write_text((ROOT / "configs/deepspeed/zero3.json").read_text())
    (where / "hosts.txt").write_text("node0 slots=2\nnode1 slots=2\n")
    (where / "projval.yaml").write_text(_projval_study())
    _penguins_csv(where / "penguins.csv")
    (where / "projval_tp.yaml").write_text(_projval_study(tp=True))
    return where


def _houses_csv(path: Path) -> None:
    """'your own CSV file': three feature columns and a price in units of its own."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rooms, area, age = rng.integers(1, 7, 400), rng.uniform(30, 250, 400), rng.uniform(0, 80, 400)
    price = 20_000 * rooms + 1_500 * area - 800 * age + rng.normal(0, 10_000, 400)
    rows = [
        "rooms,area,age,price",
        *(f"{r},{a:.1f},{g:.1f},{p:.0f}" for r, a, g, p in zip(rooms, area, age, price, strict=True)),
    ]
    path.write_text("\n".join(rows) + "\n")


def _penguins_csv(path: Path) -> None:
    """penguins.csv as docs/models.md copies it out of the installed palmerpenguins package."""
    shipped = importlib.resources.files("palmerpenguins") / "data/penguins.csv"
    path.write_bytes(shipped.read_bytes())


def _projval_study(tp: bool = False) -> str:
    """The validation study docs/projection.md shows as YAML; with ``tp``, the one it describes
    in words as "the projval one above with strategy: [single, tp, fsdp2] and repeats: 2"."""
    text = (ROOT / "docs/projection.md").read_text()
    block = re.search(r"```yaml\n(study: projval\n.*?)```", text, re.S).group(1)
    if not tp:
        return block
    block = re.sub(r"strategy: \[.*?\]", "strategy: [single, tp, fsdp2]", block)
    return block.replace("matrix:", "repeats: 2\nmatrix:", 1)


def placeholders_filled(argv: tuple[str, ...], sandbox: Path) -> list[str]:
    """The command's words with what the docs leave to the reader filled in: ``$NODE_RANK`` (0:
    this is node 0), ``~`` (the home directory), ``runs/<run_id>`` (the newest run under the
    sandbox's runs/, or a name that stands for one)."""
    newest = newest_run(sandbox)
    run = str(newest.relative_to(sandbox)) if newest else "runs/a-run"
    filled = []
    for word in argv:
        word = word.replace("$NODE_RANK", "0").replace("runs/<run_id>", run)
        filled.append(str(Path(word).expanduser()) if word.startswith("~") else word)
    return filled


def newest_run(sandbox: Path) -> Path | None:
    """The run directory under the sandbox's runs/ whose record was written last."""
    records = sorted((sandbox / "runs").glob("*/summary.json"), key=lambda p: p.stat().st_mtime)
    return records[-1].parent if records else None


def kanscale_words(words: list[str]) -> list[str]:
    """The words ``kanscale`` itself parses: after the program name, or after ``-m
    launchers.cli`` under a launcher."""
    if Path(words[0]).name == "kanscale":
        return list(words[1:])
    return list(words[words.index("launchers.cli") + 1 :])
