"""``kanscale bench``: forward, backward and train-step time, throughput and memory of the zoo's
implementations on standard workloads, all measured in one run on one machine: the plan (the
flags, checked), the measurements, and the Markdown table (docs/performance.md).

Every implementation trains the same batch (inputs uniform on [-1, 1], target sum x_i^2) with
MSE and Adam (torch's fused kernel, lr 1e-3). Per measurement: ``warmup`` train steps, then
``repeats`` timed train steps (each after ``settle`` untimed ones: the implementations take
turns), each split into forward (model and loss), backward, and optimizer step, reported as
median and min-max. Bytes saved for backward are counted once, outside the timings, with
saved-tensor hooks: the storage of every tensor autograd packs, each storage once, not counting
parameters and buffers (they live anyway). On CUDA every phase is bracketed by
``torch.cuda.synchronize`` and the peak of ``torch.cuda.max_memory_allocated`` over one train step
is reported too.

How far each step is from the machine's arithmetic limit: the step's arithmetic is taken as
6 x batch x trainable parameters (a multiply-add per weight and sample forward, two backward: the
dense-network rule, which for a KAN layer is its spline and base GEMMs over all G + k bases), the
limit is that over the machine's dense GEMM rate, measured here on the same threads and dtype,
and the ``of limit`` column is the limit's time over the measured train step.
"""

from __future__ import annotations

import contextlib
import datetime
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kan_models import build_model, parse_model_config
from kan_models.compile import compile_model
from kanscale.machine import cpu_model
from launchers.bench_catalog import (
    DEFAULT_IMPLS,
    DEFAULT_WORKLOADS,
    IMPLEMENTATIONS,
    WORKLOADS,
    implementation_config,
    split_impl,
)
from strategies.step.compiled_step import StepCompilation


@dataclass(frozen=True)
class Plan:
    workloads: list[str]
    impls: list[str]
    threads: int
    repeats: int | None
    device: torch.device


def make_plan(models: str | None, impls: str | None, threads: int, repeats: int | None, device: str) -> Plan:
    """Validate the ``kanscale bench`` flags; ValueError names the flag and the fix."""

    def names(text: str | None, known: list[str], default: list[str], flag: str, suffixes: bool = False) -> list[str]:
        chosen = [n.strip() for n in text.split(",") if n.strip()] if text else default
        for n in chosen:
            if (split_impl(n)[0] if suffixes else n) not in known:
                raise ValueError(
                    f"{flag}: unknown name {n!r}; choose from {', '.join(known)}"
                    + (" (append +compile to compile the model, +step the whole step)" if suffixes else "")
                )
        if not chosen:
            raise ValueError(f"{flag}: give at least one name, e.g. {known[0]}")
        return chosen

    workloads = names(models, list(WORKLOADS), DEFAULT_WORKLOADS, "--models")
    chosen = names(impls, IMPLEMENTATIONS, DEFAULT_IMPLS, "--impl", suffixes=True)
    if threads < 1:
        raise ValueError(f"--threads: must be at least 1, got {threads}")
    if repeats is not None and repeats < 1:
        raise ValueError(f"--repeats: must be at least 1, got {repeats}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device: choose auto, cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device: cuda requested but torch sees no CUDA device; use --device cpu")
    return Plan(workloads, chosen, threads, repeats, torch.device(device))


def saved_bytes(model: nn.Module, step_loss: Callable[[], torch.Tensor], checkpointed: Iterable[nn.Module] = ()) -> int:
    """Bytes of the storages autograd keeps for backward in one forward, each storage once,
    parameters and buffers excluded; with ``checkpointed`` units (activation checkpointing), the
    inputs each keeps for its recomputation in their place (what it saves inside is not kept)."""
    live_state = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    packed: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in live_state:
            packed[storage._cdata] = storage.nbytes()
        return t

    def inputs(_unit: nn.Module, args: tuple) -> None:
        for t in args:
            if isinstance(t, torch.Tensor):
                keep(t)

    hooks = [unit.register_forward_pre_hook(inputs) for unit in checkpointed]
    try:
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            loss = step_loss()
    finally:
        for hook in hooks:
            hook.remove()
    del loss  # frees the graph without running backward
    return sum(packed.values())


def gemm_rate(device: torch.device, size: int = 2048, repeats: int = 3) -> float:
    """The machine's dense float32 GEMM rate in FLOP/s: the best of ``repeats`` square products."""
    a, b = (torch.randn(size, size, device=device) for _ in range(2))
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def _spread(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1e3 for s in seconds]
    return {"median": statistics.median(ms), "min": min(ms), "max": max(ms)}


class Measurement:
    """One implementation on one workload: model, optimizer and data built (compiled for +compile),
    then one train step per :meth:`round`, each phase stamped. A workload's implementations take
    their rounds in turn (A, B, C, A, B, C, ...): a load change during the run touches every row
    alike, where run one after another it would move some rows and not others. Where the workload
    settles, each turn starts with that many untimed rounds."""

    def __init__(self, workload: str, impl: str, plan: Plan) -> None:
        w = self.workload = WORKLOADS[workload]
        base, self.mode = split_impl(impl)
        self.row: dict[str, Any] = {"workload": workload, "impl": impl, "batch": w.batch}
        cfg = parse_model_config(implementation_config(base, w.widths, w.grid, w.k))
        self.model = model = build_model(cfg, seed=0).to(plan.device)
        self.row.update(model=cfg.describe(), params=sum(p.numel() for p in model.parameters() if p.requires_grad))
        gen = torch.Generator().manual_seed(0)
        self.x = (torch.rand(w.batch, w.widths[0], generator=gen) * 2 - 1).to(plan.device)
        self.y = self.x.square().sum(1, keepdim=True)
        self.device = plan.device
        self.row["compile_s"] = compile_model(model, self.x)[1] if self.mode == "+compile" else None
        # Eager and +compile: torch's fused Adam. +step compiles Adam's own step into one kernel.
        self.opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=self.mode != "+step")
        self.forward = lambda x, y: F.mse_loss(model(x), y)
        self.backward: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        self.optimizer_step = self.opt.step
        if self.mode == "+step":
            compiled = StepCompilation(self.opt, compiled_autograd=True)
            self.forward = compiled.region(self.forward)
            self.backward, self.optimizer_step = compiled.backward, compiled.optimizer_step
        self.phases: dict[str, list[float]] = {"forward_ms": [], "backward_ms": [], "step_ms": []}
        self.starts: list[float] = []  # when each round began (perf_counter)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def round(self, timed: bool) -> None:
        """One train step; its phases kept where ``timed`` (after the workload's warm-up)."""
        self.opt.zero_grad(set_to_none=True)
        self._sync()
        t0 = time.perf_counter()
        self.starts.append(t0)
        loss = self.forward(self.x, self.y)
        self._sync()
        t1 = time.perf_counter()
        with self.backward():
            loss.backward()
        self._sync()
        t2 = time.perf_counter()
        self.optimizer_step()
        self._sync()
        t3 = time.perf_counter()
        if len(self.starts) == 1 and self.mode == "+step":
            self.row["compile_s"] = t3 - t0  # the whole step compiles in its first call
        if timed:
            for name, seconds in zip(self.phases, (t1 - t0, t2 - t1, t3 - t0), strict=True):
                self.phases[name].append(seconds)

    def result(self) -> dict[str, Any]:
        row = {**self.row, **{name: _spread(seconds) for name, seconds in self.phases.items()}}
        row["samples_per_s"] = self.workload.batch / (row["step_ms"]["median"] / 1e3)
        row["step_flops"] = 6 * self.workload.batch * row["params"]
        row["saved_bytes"] = saved_bytes(self.model, lambda: self.forward(self.x, self.y))
        row["peak_device_bytes"] = (
            _peak_device_bytes(self.model, self.opt, self.x, self.y) if self.device.type == "cuda" else None
        )
        return {**row, "status": "ok"}


def failed(row: dict[str, Any], err: Exception) -> dict[str, Any]:
    """A row for an implementation that failed (e.g. a compile error): it must not end the run."""
    return {**row, "status": "failed", "note": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}


def measure_workload(
    workload: str,
    impls: list[str],
    plan: Plan,
    progress: Callable[[str], None] = lambda line: None,
    measured: dict[str, Measurement] | None = None,
) -> list[dict[str, Any]]:
    """Every implementation of the plan on one workload, their rounds interleaved; a row each,
    in the plan's order (``measured``, if given, receives each implementation's Measurement)."""
    w = WORKLOADS[workload]
    rows: dict[str, dict[str, Any]] = {}
    ready: dict[str, Measurement] = {}
    for impl in impls:
        base_row = {"workload": workload, "impl": impl, "batch": w.batch}
        if reason := w.skip.get(split_impl(impl)[0].split("-")[0]):
            rows[impl] = {**base_row, "status": "skipped", "note": reason}
            continue
        try:
            ready[impl] = Measurement(workload, impl, plan)
        except Exception as err:
            rows[impl] = failed(base_row, err)
    if measured is not None:
        measured.update(ready)
    repeats = plan.repeats or w.repeats
    for n in range(w.warmup + repeats):
        for impl, m in list(ready.items()):
            try:
                for _ in range(w.settle):
                    m.round(timed=False)
                m.round(timed=n >= w.warmup)
            except Exception as err:
                rows[impl] = failed(m.row, err)
                del ready[impl]
        progress(f"{workload}: round {n + 1} of {w.warmup + repeats} ({len(ready)} implementation(s) in turn)")
    for impl, m in ready.items():
        try:
            rows[impl] = m.result()
        except Exception as err:
            rows[impl] = failed(m.row, err)
        progress(f"{workload} {impl}: {_progress_line(rows[impl])}")
    return [rows[impl] for impl in impls]


def _peak_device_bytes(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> int:
    torch.cuda.synchronize(x.device)
    torch.cuda.reset_peak_memory_stats(x.device)
    opt.zero_grad(set_to_none=True)
    F.mse_loss(model(x), y).backward()
    opt.step()
    torch.cuda.synchronize(x.device)
    return torch.cuda.max_memory_allocated(x.device)


def add_ratios(rows: list[dict[str, Any]], flops_per_s: float) -> None:
    """Throughput relative to eager pykan and to the eager reference B-spline of the same
    workload, bytes saved for backward relative to the reference's, and the fraction of the
    arithmetic limit (at ``flops_per_s``) each train step reaches."""
    ok = {(r["workload"], r["impl"]): r for r in rows if r["status"] == "ok"}
    for r in rows:
        if r["status"] == "ok":
            r["limit_fraction"] = r["step_flops"] / flops_per_s / (r["step_ms"]["median"] / 1e3)
        pykan, ref = ok.get((r["workload"], "pykan")), ok.get((r["workload"], "reference"))
        ours = r["status"] == "ok"
        r["vs_pykan"] = r["samples_per_s"] / pykan["samples_per_s"] if ours and pykan else None
        r["vs_reference"] = r["samples_per_s"] / ref["samples_per_s"] if ours and ref else None
        r["saved_vs_reference"] = r["saved_bytes"] / ref["saved_bytes"] if ours and ref and ref["saved_bytes"] else None


def environment(plan: Plan) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        pykan = version("pykan")
    except PackageNotFoundError:
        pykan = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "gpu": torch.cuda.get_device_name(plan.device) if plan.device.type == "cuda" else None,
        "device": plan.device.type,
        "threads": plan.threads,
        "torch": torch.__version__,
        "pykan": pykan,
        "python": platform.python_version(),
    }


def run(plan: Plan, progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Measure every (workload, implementation) pair of the plan; returns the JSON document."""
    threads = torch.get_num_threads()
    torch.set_num_threads(plan.threads)
    try:
        flops_per_s = gemm_rate(plan.device)
        progress(f"dense float32 GEMM rate: {flops_per_s / 1e9:,.1f} GFLOP/s on {plan.threads} thread(s)")
        rows = []
        for workload in plan.workloads:
            start = time.perf_counter()
            rows += measure_workload(workload, plan.impls, plan, progress)
            progress(f"{workload}: {time.perf_counter() - start:.0f} s")
        add_ratios(rows, flops_per_s)
        return {
            "environment": {**environment(plan), "gemm_flops_per_s": flops_per_s},
            "workloads": {
                n: {
                    "widths": WORKLOADS[n].widths,
                    "grid": WORKLOADS[n].grid,
                    "k": WORKLOADS[n].k,
                    "batch": WORKLOADS[n].batch,
                    "about": WORKLOADS[n].about,
                }
                for n in plan.workloads
            },
            "results": rows,
        }
    finally:
        torch.set_num_threads(threads)


def _progress_line(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return f"{row['status']}: {row['note']}"
    return f"step {row['step_ms']['median']:.3f} ms, {row['samples_per_s']:,.0f} samples/s"


def markdown(doc: dict[str, Any]) -> str:
    """One table per workload, with the machine named above them."""
    env = doc["environment"]
    hardware = env["gpu"] or env["cpu"]
    lines = [
        f"Measured {env['date']} on {hardware} ({env['device']}, {env['threads']} thread(s)), "
        f"torch {env['torch']}, pykan {env['pykan']}. Times in ms: median (min-max); "
        "ratios: samples/s over eager pykan's and the eager reference B-spline's, "
        "saved bytes over the reference's; of limit: the step's arithmetic (6 x batch x parameters) at the "
        f"machine's measured dense GEMM rate ({env['gemm_flops_per_s'] / 1e9:,.1f} GFLOP/s) over the train step."
    ]
    for name, w in doc["workloads"].items():
        lines += [
            "",
            f"**{name}**: {w['about']}, widths {w['widths']}, grid {w['grid']}, k {w['k']}, batch {w['batch']}",
            "",
            "| impl | compile s | forward | backward | train step | samples/s | x pykan | x reference "
            "| of limit | saved for backward | x reference | peak device |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in (r for r in doc["results"] if r["workload"] == name):
            if r["status"] != "ok":
                lines.append(f"| {r['impl']} | {r['status']}: {r['note']} |" + " |" * 10)
                continue
            cells = [
                r["impl"],
                _num(r["compile_s"], ".1f"),
                _ms(r["forward_ms"]),
                _ms(r["backward_ms"]),
                _ms(r["step_ms"]),
                f"{r['samples_per_s']:,.0f}",
                _num(r["vs_pykan"], ".1f", "x"),
                _num(r["vs_reference"], ".2f", "x"),
                _num(100 * r["limit_fraction"], ".1f", "%"),
                _bytes(r["saved_bytes"]),
                _num(r["saved_vs_reference"], ".3f"),
                _bytes(r["peak_device_bytes"]),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _ms(spread: dict[str, float]) -> str:
    digits = 3 if spread["median"] < 10 else 1
    return f"{spread['median']:.{digits}f} ({spread['min']:.{digits}f}-{spread['max']:.{digits}f})"


def _num(value: float | None, fmt: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{unit}"


def _bytes(count: int | None) -> str:
    if count is None:
        return "-"
    n = float(count)
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"
