"""The layout holds, checked from the source the way a reviewer would: imports point one way
(docs/architecture.md), modules stay short, no code outside the strategy modules knows a
strategy by its name, and the package list in pyproject.toml covers the tree."""

import ast
from pathlib import Path

import pytest
import tomllib

from kanscale.files import preset_names
from strategies.registry import STRATEGIES

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kanscale", "kan_models", "strategies", "launchers", "analysis")
# What each layer may import of the project (besides itself): docs/architecture.md.
MAY_IMPORT = {
    "kanscale": set(),
    "kan_models": {"kanscale"},
    "analysis": {"kanscale"},
    "strategies": {"kanscale", "kan_models", "analysis"},
    "launchers": {"kanscale", "kan_models", "analysis", "strategies"},
}
# The ground floor of analysis: the schema, record I/O and loading, which every layer reads and writes.
RECORDS = "analysis.records"
# Where strategies may be known by name: their own modules (strategies/backends/) and the registry;
# the v1 migration translates what v1 records meant (analysis/records/migrate.py says why).
NAME_AWARE = {"strategies/registry.py", "analysis/records/migrate.py"}
NAME_AWARE_FOLDERS = ("strategies/backends/",)


def sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every project module ``path`` imports, at any depth (function-level imports included)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return [(line, name) for line, name in found if name.split(".")[0] in PACKAGES]


def test_imports_point_one_way():
    wrong = []
    for path in sources():
        here = module_name(path)
        layer = here.split(".")[0]
        for line, name in imported_modules(path):
            target = name.split(".")[0]
            if target != layer and target not in MAY_IMPORT[layer]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({layer}) imports {name}")
            if here.startswith(RECORDS) and target == "analysis" and not name.startswith(RECORDS + "."):
                wrong.append(f"{path.relative_to(ROOT)}:{line}: the record modules import only each other, not {name}")
    assert not wrong, "\n".join(wrong)


def test_the_layer_check_sees_a_violation(tmp_path):
    """The check above would catch an upward import (it is not vacuous)."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from launchers.cli import main\n")
    assert imported_modules(bad) == [(2, "launchers.cli")]


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports, at any depth; ``from a.b import c`` counts as
    a.b.c where that is a module, else as a.b."""
    graph = {}
    for here, path in modules.items():
        targets = set()
        for _, name in imported_modules(path):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            targets.add(name)
        graph[here] = targets - {here, ""}
    return graph


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of imports (its modules in order, the first repeated at the end), or []."""
    state: dict[str, str] = {}  # "open" while on the path being walked, "done" after

    def walk(module: str, path: list[str]) -> list[str]:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := walk(target, [*path, target])):
                return cycle
        state[module] = "done"
        return []

    for module in sorted(graph):
        if module not in state and (cycle := walk(module, [module])):
            return cycle
    return []


def test_no_module_imports_itself_through_others():
    """No circle of imports, module-level or inside functions: what two modules share lives in a
    module below both (docs/architecture.md)."""
    cycle = import_cycle(import_graph({module_name(p): p for p in sources()}))
    assert not cycle, " -> ".join(cycle)


def test_the_cycle_check_sees_a_circle_through_a_function_level_import(tmp_path):
    (tmp_path / "a.py").write_text("from kan_models.b import f\n")
    (tmp_path / "b.py").write_text("def f():\n    from kan_models.a import g\n")
    graph = import_graph({"kan_models.a": tmp_path / "a.py", "kan_models.b": tmp_path / "b.py"})
    assert import_cycle(graph) == ["kan_models.a", "kan_models.b", "kan_models.a"]


def test_no_module_is_over_400_lines():
    long = [f"{p.relative_to(ROOT)} ({n} lines)" for p in sources() if (n := len(p.read_text().splitlines())) > 400]
    assert not long, long


def strategy_names() -> set[str]:
    return set(STRATEGIES) | set(preset_names("strategies"))


def name_comparisons(path: Path, names: set[str]) -> list[str]:
    """Comparisons (==, !=, in) of a strategy name literal, except with a launcher: two launchers
    share their names with strategies (deepspeed, accelerate)."""
    source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        literals = [
            c.value
            for o in operands
            for c in ([o] if isinstance(o, ast.Constant) else getattr(o, "elts", []))
            if isinstance(c, ast.Constant)
        ]
        others = " ".join(ast.get_source_segment(source, o) or "" for o in operands if not isinstance(o, ast.Constant))
        if (
            any(v in names for v in literals if isinstance(v, str))
            and "launcher" not in others
            and "inner" not in others
        ):
            found.append(f"{path.name}:{node.lineno}: {ast.get_source_segment(source, node)}")
    return found


def test_no_code_outside_the_strategy_modules_compares_a_strategy_name():
    names = strategy_names()
    assert {"ddp", "zero3_offload", "deepspeed"} <= names
    found = [
        hit
        for p in sources()
        if (where := str(p.relative_to(ROOT))) not in NAME_AWARE and not where.startswith(NAME_AWARE_FOLDERS)
        for hit in name_comparisons(p, names)
    ]
    assert not found, "declare it on the strategy's class instead:\n" + "\n".join(found)


def test_the_name_check_sees_a_comparison(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        'def f(cfg, spec):\n    if cfg.strategy.name == "ddp" or spec.launcher == "deepspeed":\n        pass\n'
        '    return cfg.label in ("zero3", "x")\n'
    )
    hits = sorted(name_comparisons(bad, strategy_names()))
    assert len(hits) == 2 and '== "ddp"' in hits[0] and "zero3" in hits[1]


@pytest.mark.parametrize("preset", list(preset_names("strategies")))
def test_every_preset_is_named_by_the_label_of_what_it_runs(preset):
    """One vocabulary: the preset file, the record's label, the tables and the projection agree."""
    from strategies.experiment import load_experiment

    assert load_experiment("quickstart", strategy=preset).strategy.label() == preset


def test_no_table_in_analysis_is_keyed_by_strategy_labels():
    """Strategies describe themselves (their cost model, their label); analysis/ keeps no table of
    them, so a strategy of the user's own projects and analyzes with no change here."""
    names = strategy_names()
    tables = []
    for path in sorted((ROOT / "analysis").rglob("*.py")):
        if str(path.relative_to(ROOT)) in NAME_AWARE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value in names for k in node.keys):
                tables.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not tables, tables


def test_pyproject_lists_every_package():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {module_name(p) for p in sources() if p.name == "__init__.py"} | {"kanscale.configs"}
    assert listed == on_disk


def test_every_tier_runs_in_ci():
    """make test leaves the slow tier out; .ci/run runs make check's two halves (lint and format,
    then types beside the tests), make test-both (every test outside tests/cluster, slow or not,
    in one session) and make test-cluster, so nothing goes untested."""
    makefile, ci = (ROOT / "Makefile").read_text(), (ROOT / ".ci/run").read_text()
    assert '-m "not slow"' in makefile and "-m slow" in makefile
    ran = [line.split()[1] for line in ci.splitlines() if line.strip().startswith("make ")]
    assert ran == ["lint", "types", "test-both", "test-cluster"]
    assert 'wait "$types"' in ci  # the types' verdict is waited for, not left behind

    def recipe(target: str) -> str:
        return makefile.split(f"\n{target}:", 1)[1].split("\n\n", 1)[0]

    assert "$(PYTEST) tests --ignore=tests/cluster" in recipe("test-both") and " -m " not in recipe("test-both")
    assert recipe("check").split()[:2] == ["lint", "types"]
    assert "ruff check" in recipe("lint") and "ruff format --check" in recipe("lint") and "mypy" in recipe("types")
