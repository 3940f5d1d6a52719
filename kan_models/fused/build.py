"""The fused op's build: ahead of time by ``kanscale build-ops`` (or ``python -m kan_models.fused``),
which ``make install`` runs; whether it can be built here at all; and
its load, which never compiles inside a step.

Where builds live (the suite's one policy for what it compiles): with the environment whose torch
they are compiled against, in :func:`kanscale.extensions.extensions_dir` (``$TORCH_EXTENSIONS_DIR``,
else ``<venv>/torch_extensions``), one folder per CPU, torch version, source and flags, so a
second build of the same sources is never made. What is measured about the machine (the sparse
product's crossover) lives in ``$KANSCALE_CACHE_DIR`` instead: tests point that at an empty folder
and still find the op built.

Whether the op can be built is answered by building a probe once per environment, CPU and
compiler: a few lines with torch's headers and an OpenMP loop, compiled and loaded with the op's
own flags. A machine without a compiler, OpenMP or torch's headers fails the probe, not a
training step; the verdict is kept beside the builds.

Builders take a lock of their own (host and process id) around cpp_extension's: cpp_extension
waits forever on the ``lock`` file a killed build leaves, so a lock whose process is gone (or, from
another host, older than :data:`STALE_AFTER_S`) is cleared, with a line saying so.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from kan_models.sparse_crossover import machine_key
from kanscale import log
from kanscale.extensions import extensions_dir, keep_builds_in_environment

SOURCES = Path(__file__).with_name("csrc")
# -fno-trapping-math: without it GCC keeps std::floor (every input's cell) scalar, to preserve
# floating-point exception flags that nothing reads
CFLAGS = ("-O3", "-march=native", "-fno-trapping-math", "-fopenmp")
LDFLAGS = ("-fopenmp",)
# A build takes about a minute; a lock older than this from a host whose processes this one
# cannot see is taken to be left by a killed build.
STALE_AFTER_S = 30 * 60
LOCK = "kanscale.lock"
BUILT = "built"  # written once the build finished, beside the library
# What the probe compiles: torch's headers (load_inline includes torch/extension.h) and OpenMP.
PROBE = """
#include <omp.h>
int omp_threads() {
  int n = 0;
#pragma omp parallel reduction(+ : n)
  n += 1;
  return n;
}
"""

_log = log.get(__name__)


def compiler() -> str:
    return os.environ.get("CXX", "c++")


@functools.cache
def _sources_digest() -> bytes:
    files = sorted(f for f in SOURCES.iterdir() if f.suffix in (".cpp", ".h"))
    return hashlib.sha256(b"".join(f.name.encode() + f.read_bytes() for f in files)).digest()


def _key(*parts: bytes | str) -> str:
    text = [machine_key(), " ".join(CFLAGS + LDFLAGS), *parts]
    return hashlib.sha256(b"\0".join(p.encode() if isinstance(p, str) else p for p in text)).hexdigest()[:16]


def build_directory() -> Path:
    """Where the op is built: one directory per CPU, torch version, source and flags."""
    return extensions_dir() / f"kanscale_bspline_fused_{_key(_sources_digest())}"


def library(where: Path) -> Path:
    return where / f"kanscale_{where.name}.so"


def is_built() -> bool:
    """Whether a build finished: the library alone may be one a killed link cut short, which
    crashes the process that loads it."""
    return (build_directory() / BUILT).is_file() and library(build_directory()).is_file()


def fused_unavailable() -> str | None:
    """Why the fused op cannot be built here, or None: None at once where it is built, else the
    probe's verdict (built once per environment, CPU and compiler, then read)."""
    if is_built():
        return None
    if shutil.which(compiler()) is None:
        return f"no C++ compiler ({compiler()}) to build the fused B-spline op (set CXX, or install g++)"
    return probe_verdict()


def probe_directory() -> Path:
    """Where the probe is built and its verdict kept: one per CPU, torch version, compiler and flags."""
    return extensions_dir() / f"kanscale_probe_{_key(compiler(), PROBE)}"


def probe_verdict() -> str | None:
    where = probe_directory()
    verdict = where / "verdict.json"
    if not verdict.is_file():
        with locked(where, "the fused op's probe"):
            if not verdict.is_file():  # another process may have probed while this one waited
                _write_atomically(verdict, json.dumps({"unavailable": _run_probe(where)}))
    reason = json.loads(verdict.read_text()).get("unavailable")
    return reason if isinstance(reason, str) else None


def _run_probe(where: Path) -> str | None:
    """Compile and load the probe; why it failed, or None."""
    from torch.utils.cpp_extension import load_inline

    keep_builds_in_environment()  # the environment's ninja, as every process of the suite uses
    _log.info(f"checking once that {compiler()} builds the fused B-spline op here (OpenMP, torch's headers) in {where}")
    try:
        probe = load_inline(
            name=f"kanscale_{where.name}",
            cpp_sources=PROBE,
            functions=["omp_threads"],
            build_directory=str(where),
            extra_cflags=list(CFLAGS),  # copies: cpp_extension appends to the lists it is given
            extra_ldflags=list(LDFLAGS),
        )
        if probe.omp_threads() < 1:
            return "the fused B-spline op's OpenMP probe ran no thread"
    except Exception as err:  # a compiler, linker or loader failure: each says why in its text
        (where / "probe.log").write_text(str(err))
        return f"the fused B-spline op cannot be built here: {_first_error(str(err))} (log: {where / 'probe.log'})"
    return None


def _first_error(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return next((line for line in lines if "error" in line.lower() and "Error building" not in line), lines[0])


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


@contextlib.contextmanager
def locked(where: Path, what: str) -> Iterator[None]:
    """Hold ``where``'s build lock: wait for a live builder, clear a dead one's (and the
    cpp_extension ``lock`` it left), release on the way out."""
    where.mkdir(parents=True, exist_ok=True)
    path = where / LOCK
    waiting = False
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            holder = _stale_holder(path)
            if holder:
                _log.warning(f"clearing a stale build lock in {where} ({holder})")
                path.unlink(missing_ok=True)
            elif not waiting:
                _log.info(f"waiting for another process building {what} in {where}")
                waiting = True
            time.sleep(0 if holder else 1)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{socket.gethostname()} {os.getpid()}\n")
        break
    try:
        if (where / "lock").exists():  # every builder holds this lock first: cpp_extension's is left over
            _log.warning(f"clearing the lock a killed build left in {where}")
            (where / "lock").unlink(missing_ok=True)
        yield
    finally:
        path.unlink(missing_ok=True)


def _stale_holder(path: Path) -> str | None:
    """Who left a lock that no live process holds, or None while its holder may still run."""
    try:
        text, age = path.read_text(), time.time() - path.stat().st_mtime
    except OSError:
        return None  # just released: look again
    try:
        host, pid = text.split()
    except ValueError:  # being written, or its writer was killed before it wrote
        return f"left empty {age:.0f} s ago" if age > 60 else None
    if host == socket.gethostname():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return f"process {pid} is no longer running"
        except PermissionError:
            return None  # another user's live process
        return None
    return f"left by {host} {age / 60:.0f} minutes ago" if age > STALE_AFTER_S else None


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(verbose: bool = False) -> Path:
    """Build the op where it is not built (a line when it starts and when it ends, the compiler's
    commands too where ``verbose``); the built library's path."""
    from torch.utils.cpp_extension import load

    keep_builds_in_environment()  # the environment's ninja, as every process of the suite uses
    where = build_directory()
    with locked(where, "the fused B-spline op"):
        if is_built():
            return library(where)
        if reason := fused_unavailable():
            raise RuntimeError(reason)
        cpp = sorted(SOURCES.glob("*.cpp"))
        _log.info(
            f"building the fused B-spline op ({len(cpp)} C++ files, about a minute on 2 cores) with {compiler()} "
            f"in {where}"
        )
        start = time.perf_counter()
        load(
            name=f"kanscale_{where.name}",
            sources=[str(f) for f in cpp],
            build_directory=str(where),
            extra_cflags=list(CFLAGS),  # copies: cpp_extension appends to the lists it is given
            extra_ldflags=list(LDFLAGS),
            verbose=verbose,
        )
        (where / BUILT).write_text(f"{library(where).name}\n")
        _log.info(f"built the fused B-spline op in {time.perf_counter() - start:.0f} s")
    return library(where)


@functools.cache
def extension() -> ModuleType:
    """The op, loaded from its build; built first where it is not (with a line saying so), which
    the model's construction asks for, so that no training step compiles."""
    if not is_built():
        _log.warning("the fused B-spline op is not built yet: building it now (kanscale build-ops builds it ahead)")
    return _load(build())


def main(argv: list[str] | None = None) -> int:
    """``python -m kan_models.fused``, as ``kanscale build-ops``."""
    parser = argparse.ArgumentParser(
        prog="python -m kan_models.fused", description="Build the fused B-spline op ahead of time."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="show the compiler's commands")
    parser.add_argument(
        "--if-possible",
        action="store_true",
        help="where the op cannot be built here, say why and succeed (model.impl auto then runs the fast layer)",
    )
    args = parser.parse_args(argv)
    log.configure(0)
    return run(if_possible=args.if_possible, verbose=args.verbose)


def run(if_possible: bool = False, verbose: bool = False) -> int:
    """Build the op; 0 when it is built (or, ``if_possible``, cannot be), else 1. A probe that
    failed before is run again: what it lacked may have been installed since."""
    verdict = probe_directory() / "verdict.json"
    if verdict.is_file() and json.loads(verdict.read_text()).get("unavailable"):
        verdict.unlink()
    if (reason := fused_unavailable()) and if_possible:
        _log.warning(f"{reason}; model.impl auto runs the fast layer")
        return 0
    try:
        path = build(verbose=verbose)
    except RuntimeError as err:
        _log.error(str(err))
        return 1
    _log.info(f"the fused B-spline op is built: {path}")
    return 0
