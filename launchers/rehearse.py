"""``kanscale rehearse``: each strategy's own code at a target's world size and mesh, one strategy
per process here (strategies/rehearsal/), and what each rank would hold and issue per step."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from analysis.report.documents import json_out, write_json_and_markdown
from analysis.report.format import human_bytes
from kanscale import log
from kanscale.errors import ConfigError
from kanscale.files import preset_names
from strategies.experiment import load_experiment
from strategies.rehearsal.rehearse import rehearse_or_refusal
from strategies.rehearsal.result import Refusal, Rehearsal

logger = log.get(__name__)


@dataclass(frozen=True)
class RehearsalRequest:
    config: str
    overrides: list[str]
    strategies: str | None
    nnodes: int
    nproc_per_node: int
    rank: int
    json: str | None


def check(r: RehearsalRequest) -> list[str]:
    """The strategies to rehearse, after everything that can be refused before a process starts."""
    names = [s.strip() for s in r.strategies.split(",") if s.strip()] if r.strategies else preset_names("strategies")
    if not names:
        raise ConfigError("--strategies: name at least one preset, e.g. --strategies ddp,zero2,fsdp2")
    world = r.nnodes * r.nproc_per_node
    if not 0 <= r.rank < world:
        raise ConfigError(f"--rank: {r.rank} is not a rank of {world} ranks; give 0 to {world - 1}")
    for name in names:
        load_experiment(r.config, r.overrides, strategy=name)  # the file, the overrides and the preset
    if r.json:
        json_out(r.json, "--json")
    return names


def _rehearse_into(r: RehearsalRequest, strategy: str, out: str) -> None:
    """In the child: one rehearsal, written as JSON to ``out``."""
    # DeepSpeed calls the collectives torch 2.13 renamed: its notice, nothing a user can act on,
    # would repeat for every ZeRO preset of the table
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    cfg = load_experiment(r.config, r.overrides, strategy=strategy)
    result = rehearse_or_refusal(cfg, r.nnodes * r.nproc_per_node, r.nproc_per_node, r.rank)
    kind = "rehearsal" if isinstance(result, Rehearsal) else "refusal"
    Path(out).write_text(json.dumps({kind: result.model_dump(mode="json")}))


@contextlib.contextmanager
def rehearsal_children() -> Iterator[None]:
    """Around a command's rehearsals (:func:`rehearse_in_child`): afterwards the fork server and
    multiprocessing's resource tracker it started are stopped, so that no process of theirs
    outlives the rehearsals (a user's sweep or a test counting its children would meet them)."""
    try:
        yield
    finally:
        from multiprocessing import forkserver, resource_tracker

        helpers: tuple[Any, ...] = (forkserver._forkserver, resource_tracker._resource_tracker)
        for helper in helpers:  # their own stop, which typeshed does not declare
            with contextlib.suppress(Exception):
                helper._stop()


def rehearse_in_child(r: RehearsalRequest, strategy: str, out: Path) -> Rehearsal | Refusal:
    """One strategy's rehearsal in a child process: backends keep process-wide state (DeepSpeed's
    groups) that a second world in one process would trip over. Forked, where the system can,
    from a fork server that has imported the rehearsal's modules once: never from this process,
    whose torch may have started threads a forked child would wait on forever (OpenMP's pool)."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        context: Any = multiprocessing.get_context("forkserver")  # typeshed's BaseContext lacks Process
        context.set_forkserver_preload([__name__])
    else:
        context = multiprocessing.get_context("spawn")
    child = context.Process(target=_rehearse_into, args=(r, strategy, str(out)))
    child.start()
    child.join()
    if child.exitcode or not out.exists():
        return Refusal(
            strategy=strategy,
            world_size=r.nnodes * r.nproc_per_node,
            reason=f"the rehearsal's process ended with exit code {child.exitcode} (its error is above)",
        )
    doc = json.loads(out.read_text())
    return Rehearsal(**doc["rehearsal"]) if "rehearsal" in doc else Refusal(**doc["refusal"])


def _links(x: Rehearsal) -> str:
    if x.comm is None:
        return "-"
    c = x.comm
    return (
        f"{c.intra_node_collectives} / {c.inter_node_collectives}; "
        f"{human_bytes(c.intra_node_bytes)} / {human_bytes(c.inter_node_bytes)}"
    )


def table(results: list[Rehearsal | Refusal], r: RehearsalRequest) -> str:
    world = r.nnodes * r.nproc_per_node
    lines = [
        f"Rehearsed at {world} ranks ({r.nnodes} node(s) x {r.nproc_per_node}) as rank {r.rank}: each strategy's "
        "own step, measured here on the fake process group (nothing sent), per rank and step, after the steps "
        "that set its backend up:",
        "",
        "| strategy | mesh | micro-batch | model state | tensor peak | of it activations | "
        "collectives intra / inter; sent intra / inter | gathered per parameter | GFLOP | kernels |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in results:
        if isinstance(x, Refusal):
            continue
        state = x.model_state
        gathered = x.gathered_per_parameter()
        lines.append(
            f"| {x.strategy} | {' x '.join(f'{k} {v}' for k, v in x.mesh.items() if v > 1) or '1'} | {x.micro_batch} | "
            f"{human_bytes(state.params + state.grads + state.optimizer + state.master_params)} | "
            f"{human_bytes(x.memory.peak)} | {human_bytes(x.memory.activations)} | {_links(x)} | "
            f"{'-' if gathered is None else f'{gathered:.3g}'} | {x.flops / 1e9:.3g} | {x.kernels} |"
        )
    refused = [x for x in results if isinstance(x, Refusal)]
    if refused:
        lines += ["", "Not rehearsed:"]
        lines += [f"- {x.strategy}: {x.reason}" for x in refused]
    lines += [
        "",
        "gathered per parameter: all-gathered elements in the step per model parameter (2 where a backend "
        "gathers for the forward and again for the backward; more: its shards are padded).",
    ]
    return "\n".join(lines)


def run_rehearsal(r: RehearsalRequest) -> int:
    names = check(r)
    world = r.nnodes * r.nproc_per_node
    results: list[Rehearsal | Refusal] = []
    with tempfile.TemporaryDirectory(prefix="kanscale-rehearse-") as scratch, rehearsal_children():
        for i, name in enumerate(names, 1):
            started = time.perf_counter()
            logger.info("rehearsing %s at %d ranks (%d/%d) ...", name, world, i, len(names))
            results.append(rehearse_in_child(r, name, Path(scratch) / f"{i}.json"))
            logger.info("  %s: %.1f s", name, time.perf_counter() - started)
    text = table(results, r)
    print(text)
    if r.json:
        doc = {
            "world_size": world,
            "nnodes": r.nnodes,
            "nproc_per_node": r.nproc_per_node,
            "rehearsals": [x.model_dump(mode="json") for x in results if isinstance(x, Rehearsal)],
            "refusals": [x.model_dump(mode="json") for x in results if isinstance(x, Refusal)],
        }
        write_json_and_markdown(r.json, doc, text + "\n", "--json")
    return 0 if any(isinstance(x, Rehearsal) for x in results) else 1
