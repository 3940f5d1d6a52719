"""Whether something else used the machine while a run was timed.

A shared machine slows a run down without anything in the run saying so: the rates drop, the
compute baseline and the training slow down together (so exposed communication stays like with
like), and the verdict ranks what was measured. What tells is the CPU time of the run's cores
that the run did not use: the kernel's per-core busy time (``/proc/stat``, over the cores this
rank may run on) less the CPU time of the run's own processes on that machine (every rank, its
DataLoader workers and compile workers: each rank's process tree, from ``/proc/<pid>/stat``),
over the same wall time. Each rank reads both at the start of its first timed window and after
the last; the ranks of one machine are summed, and the busiest machine is the run's figure.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from analysis.records.schema import OutsideLoad
from strategies.runtime.distributed import DistEnv, hostname

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# /proc/stat's busy columns: user, nice, system, irq, softirq, steal (idle and iowait are not busy).
BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)


def cores() -> set[int]:
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def busy_seconds(allowed: set[int]) -> float | None:
    """CPU seconds the ``allowed`` cores have been busy since boot; None where /proc/stat is missing."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    total = 0
    for line in lines:
        name, *values = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in allowed:
            total += sum(int(values[i]) for i in BUSY_COLUMNS if i < len(values))
    return total / TICK


def tree_seconds(root: int) -> float:
    """CPU seconds (user + system) of process ``root`` and its living descendants, with what
    the kernel has added to each for its children that already ended."""
    parents, spent = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # The command name is in parentheses and may hold spaces: the fields follow the last ')'.
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended while we looked
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        spent[pid] = sum(int(v) for v in fields[11:15]) / TICK  # utime, stime, cutime, cstime
    mine, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in mine]
        mine.update(children)
        frontier += children
    return sum(spent.get(pid, 0.0) for pid in mine)


@dataclass(frozen=True)
class Reading:
    wall: float
    busy: float | None
    own: float


def read_now() -> Reading:
    return Reading(wall=time.monotonic(), busy=busy_seconds(cores()), own=tree_seconds(os.getpid()))


def combine_outside_load(env: DistEnv, start: Reading, end: Reading) -> OutsideLoad | None:
    """Cores kept busy by other processes on the busiest machine between ``start`` and ``end``
    (a collective: every rank calls it); None where the kernel does not say."""
    mine = {
        "host": hostname(),
        "busy": None if start.busy is None or end.busy is None else end.busy - start.busy,
        "own": end.own - start.own,
        "wall": end.wall - start.wall,
        "cores": len(cores()),
    }
    hosts: dict[str, dict] = {}
    for rank in map(json.loads, env.gather_strings(json.dumps(mine))):
        if rank["busy"] is None:
            return None
        host = hosts.setdefault(
            rank["host"], {"busy": rank["busy"], "own": 0.0, "wall": rank["wall"], "cores": rank["cores"]}
        )
        host["own"] += rank["own"]
    # Ranks on one machine read the same cores' busy time; their own time adds up.
    worst = max(hosts.values(), key=lambda h: (h["busy"] - h["own"]) / max(h["wall"], 1e-9))
    wall = max(worst["wall"], 1e-9)
    return OutsideLoad(
        cores_busy=max(0.0, (worst["busy"] - worst["own"]) / wall),
        cores=worst["cores"],
        seconds=wall,
        run_cores_busy=worst["own"] / wall,
    )
