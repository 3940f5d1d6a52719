"""A cluster file (configs/clusters/*.yaml) checked whole before anything reads a value of it:
every problem of the file at once (an unknown or misspelled key, a count that is not a whole
number, a number that is not positive and finite, a range that does not hold, a link the
requested layout needs and the file lacks), each with what to write instead, in one refusal
(``kanscale recommend``, ``kanscale project``)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

from analysis.projection.collectives import nic_count
from analysis.projection.uncertainty import stated
from kanscale.errors import ConfigError

DEVICE_NUMBERS = {
    "device_memory_GiB": "the memory of one device (GPU), e.g. device_memory_GiB: 40, or give --memory-per-device",
    "device_tflops": "the achieved rate per device in TFLOP/s",
    "device_tflops_bf16": "the achieved rate per device in bf16/fp16, TFLOP/s",
    "host_us_per_kernel": "what the host spends issuing one kernel, in microseconds",
    "memory_bandwidth_GBps": "the device's memory bandwidth in 1e9 bytes/s",
    "host_optimizer_slowdown": "the host optimizer's time per the device's (ZeRO offload)",
}
TOP_KEYS = {"name", "ranks_per_node", "overlap", "links", *DEVICE_NUMBERS}
LINKS = {
    "intra": "the link between the ranks of one node",
    "inter": "the link between nodes",
    "host": "device <-> host memory, for ZeRO offload",
}
LINK_KEYS = {"alpha_us", "busbw_GBps", "nics_per_node", "busbw_GBps_per_nic"}
# the most ranks one node of a cluster file may state: beyond any machine's GPUs
MAX_RANKS_PER_NODE = 64


def _unknown(keys: Iterable[Any], known: set[str], where: str) -> list[str]:
    problems = []
    for key in keys:
        close = difflib.get_close_matches(str(key), sorted(known), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        problems.append(f"{where}{key}: unknown key; {hint}known here: {', '.join(sorted(known))}")
    return problems


def _number(doc: dict[str, Any], key: str, where: str) -> list[str]:
    try:
        stated(doc[key], f"{where}{key}")
    except ValueError as err:
        return [str(err)]
    return []


def cluster_problems(doc: Any, needs: Iterable[str] = ()) -> list[str]:
    """Every problem of a cluster document, each with its fix; ``needs``: the links the requested
    layout uses (``inter`` across nodes, ``intra`` with several ranks a node, ``host`` for
    offload), and ``device_memory_GiB`` where nothing else gives the device's memory."""
    if not isinstance(doc, dict):
        return [f"it must hold a mapping of keys (see configs/clusters/a100_ib.yaml), not {type(doc).__name__}"]
    problems = _unknown([k for k in doc if k not in TOP_KEYS], TOP_KEYS, "")
    per_node = doc.get("ranks_per_node")
    if per_node is None:
        problems.append("ranks_per_node: missing; give the ranks (GPUs) of one node, e.g. ranks_per_node: 8")
    elif isinstance(per_node, bool) or not isinstance(per_node, int) or not 1 <= per_node <= MAX_RANKS_PER_NODE:
        problems.append(f"ranks_per_node is {per_node!r}; give a whole number from 1 to {MAX_RANKS_PER_NODE}")
    if not isinstance(doc.get("overlap"), bool):
        problems.append(f"overlap is {doc.get('overlap')!r}; give true (collectives run beside compute, GPUs) or false")
    for key in DEVICE_NUMBERS:
        if key in doc:
            problems += _number(doc, key, "")
        elif key in needs:
            problems.append(f"{key}: missing; give {DEVICE_NUMBERS[key]}")
    if "host_us_per_kernel" in doc:
        problems += [
            f"{key}: missing; the per-op step time needs it beside host_us_per_kernel ({DEVICE_NUMBERS[key]})"
            for key in ("memory_bandwidth_GBps", "device_tflops")
            if key not in doc
        ]
    links = doc.get("links")
    if not isinstance(links, dict):
        return [*problems, "links: missing; give links: {intra|inter|host: {alpha_us, busbw_GBps}}"]
    problems += _unknown([k for k in links if k not in LINKS], set(LINKS), "links.")
    for name, link in links.items():
        if name not in LINKS:
            continue
        where = f"links.{name}."
        if not isinstance(link, dict):
            problems.append(f"links.{name} is {link!r}; give {{alpha_us: A, busbw_GBps: B}}")
            continue
        problems += _unknown([k for k in link if k not in LINK_KEYS], LINK_KEYS, where)
        per_nic = name == "inter" and ("nics_per_node" in link or "busbw_GBps_per_nic" in link)
        if per_nic:
            try:
                nic_count(link)  # NICs per node with a bandwidth each, never beside the node's one
            except ValueError as err:
                problems.append(str(err))
                continue
        for key in ("alpha_us", "busbw_GBps_per_nic" if per_nic else "busbw_GBps"):
            problems += _number(link, key, where) if key in link else [f"{where}{key}: missing; give it"]
    problems += [
        f"links.{name}: missing; the requested layout uses {LINKS[name]}: give {{alpha_us: A, busbw_GBps: B}}"
        for name in LINKS
        if name in needs and name not in links
    ]
    return problems


def layout_needs(nodes: int, ranks_per_node: int, offload: bool, memory_given: bool) -> set[str]:
    """What a cluster file must state for ``nodes`` x ``ranks_per_node`` ranks."""
    needs = set()
    if nodes > 1:
        needs.add("inter")
    if ranks_per_node > 1:
        needs.add("intra")
    if offload:
        needs.add("host")
    if not memory_given:
        needs.add("device_memory_GiB")
    return needs


def check_cluster(doc: Any, path: Any, needs: Iterable[str] = ()) -> None:
    """Refuse the file with every problem :func:`cluster_problems` finds, as one ``--cluster`` error."""
    problems = cluster_problems(doc, needs)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(f"--cluster: {path} has {len(problems)} problem(s); fix each:\n{lines}")
