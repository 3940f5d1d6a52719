"""What an optional package missing does: each feature that needs an extra is refused before
launch with the line that installs it, and that line names an extra pyproject.toml has, listing
the package. tests/test_extras_install.py (slow tier) installs kanscale without extras."""

from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path

import pytest

from kan_models.tasks.bundled import load_bundled
from kan_models.tasks.files import read_table
from kan_models.tasks.synthetic import feynman_equation
from kanscale.errors import ConfigError
from kanscale.extras import EXTRAS, require
from launchers.cli import main

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
DECLARED = PROJECT["optional-dependencies"]
INSTALL_LINE = re.compile(r"pip install 'kanscale\[([\w,-]+)\]'")


def distribution(requirement: str) -> str:
    """The name a requirement line installs (``pykan>=0.2.8,<0.3`` -> ``pykan``)."""
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower()


def test_every_extra_of_the_table_is_declared_with_its_packages():
    for extra, modules in EXTRAS.items():
        assert extra in DECLARED, f"pyproject.toml has no extra {extra}"
        assert set(modules.values()) <= {distribution(r) for r in DECLARED[extra]}, extra


def test_the_all_extra_holds_every_extra_and_none_is_a_dependency_too():
    (everything,) = DECLARED["all"]
    assert set(re.fullmatch(r"kanscale\[([\w,]+)\]", everything).group(1).split(",")) == set(EXTRAS)
    mandatory = {distribution(r) for r in PROJECT["dependencies"]}
    optional = {dist for modules in EXTRAS.values() for dist in modules.values()}
    assert not mandatory & optional, mandatory & optional


def test_make_install_installs_every_extra():
    """So make demo and make test, which install through it, need nothing more."""
    assert re.search(r"pip install .*'\.\[all,dev\]'", (ROOT / "Makefile").read_text())


def test_every_extra_the_docs_name_exists():
    documents = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = {(d.name, e) for d in documents for m in INSTALL_LINE.finditer(d.read_text()) for e in m[1].split(",")}
    assert named, "the docs show how to install an extra"
    assert not {(doc, extra) for doc, extra in named if extra not in DECLARED}


@pytest.fixture
def without(monkeypatch):
    """Make top-level modules unimportable in this process (``sys.modules[name] = None`` is
    what Python's import system reads as "no such module"), with the caches that would answer
    from an earlier import cleared."""

    def hide(*modules: str) -> None:
        for module in modules:
            monkeypatch.setitem(sys.modules, module, None)
        for cached in (feynman_equation, load_bundled, read_table):
            cached.cache_clear()

    yield hide
    for cached in (feynman_equation, load_bundled, read_table):
        cached.cache_clear()


def refusal(words: list[str]) -> str:
    """What ``kanscale run ... --dry-run`` prints on stderr, having refused before launch."""
    errors = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(errors):
        assert main(["run", "quickstart", *words, "--dry-run"]) == 2, errors.getvalue()
    return errors.getvalue()


FEATURES = {
    "pykan model": (("kan",), ["--set", "model.family=pykan", "--set", "model.widths=[2,5,1]"], "pykan", "pykan"),
    "feynman task": (
        ("kan",),
        ["--set", "task.name=feynman", "--set", "task.equation=I.6.20a", "--set", "model.widths=[2,5,1]"],
        "pykan",
        "pykan",
    ),
    "sklearn task": (
        ("sklearn",),
        ["--set", "task.name=sklearn", "--set", "task.dataset=iris", "--set", "model.widths=[4,5,3]"],
        "sklearn",
        "scikit-learn",
    ),
    "accelerate's DeepSpeed plugin": (
        ("transformers",),
        ["--strategy", "accelerate", "--set", "strategy.config_file=configs/accelerate/deepspeed_zero2.yaml"],
        "hf",
        "transformers",
    ),
}


@pytest.mark.parametrize("feature", FEATURES)
def test_a_feature_without_its_extra_is_refused_before_launch_with_the_install_line(
    feature, without, monkeypatch, tmp_path
):
    modules, words, extra, dist = FEATURES[feature]
    monkeypatch.chdir(ROOT)  # the accelerate config's path, as the docs give it
    without(*modules)
    printed = refusal([*words, "--nproc-per-node", "2", "--out", str(tmp_path)])
    assert f"needs {dist}" in printed and f"pip install 'kanscale[{extra}]'" in printed, printed
    assert "Traceback" not in printed


def test_a_parquet_file_without_pyarrow_is_refused_with_the_install_line(without, tmp_path):
    data = tmp_path / "cells.parquet"
    data.write_bytes(b"PAR1")  # never read: the check comes first
    without("pyarrow")
    printed = refusal(["--set", "task.name=file", "--set", f"task.path={data}", "--out", str(tmp_path)])
    assert "pip install 'kanscale[parquet]'" in printed and "needs pyarrow" in printed, printed


def test_the_install_line_names_every_missing_package_of_the_extra(without):
    without("kan", "sklearn")
    with pytest.raises(ConfigError) as refused:
        require("pykan", "model.family: pykan")
    assert str(refused.value).startswith("model.family: pykan needs pykan, scikit-learn, which are not installed")
    require("parquet", "a Parquet file")  # installed here: no error


def test_commbench_sizes_its_messages_without_pykan(without):
    """The collective benchmark labels its sizes with the zoo's gradients; without pykan it
    leaves the study's pykan model out rather than refusing the benchmark."""
    from launchers.commbench import message_sizes, zoo_gradient_bytes

    zoo_gradient_bytes.cache_clear()
    try:
        without("kan")
        labels = {label for message in message_sizes(2, 4, 1 << 30) for label in message.labels}
    finally:
        zoo_gradient_bytes.cache_clear()
    assert "study bspline gradients" in labels
    assert not any(label.startswith("study pykan") for label in labels)
