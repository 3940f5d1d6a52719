"""DeepSpeed/MPI-style hostfiles: one ``host slots=N`` line per node."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from kanscale.errors import ConfigError

LINE = re.compile(r"^(?P<host>[A-Za-z0-9_.:-]+)\s+slots\s*=\s*(?P<slots>\d+)\s*$")


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


def parse_hostfile(path: str | Path) -> list[Host]:
    """Read a hostfile; blank lines and ``#`` comments are allowed. Any other malformed line,
    a repeated host or a file without hosts is an error naming the line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--hostfile: {path} does not exist; write one 'host slots=N' line per node")
    hosts: list[Host] = []
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = LINE.match(line)
        if not match:
            raise ConfigError(f"--hostfile: {path}:{number}: {raw.strip()!r} is not 'host slots=N'")
        host = Host(match["host"], int(match["slots"]))
        if host.slots < 1:
            raise ConfigError(f"--hostfile: {path}:{number}: slots must be at least 1")
        if any(h.name == host.name for h in hosts):
            raise ConfigError(f"--hostfile: {path}:{number}: host {host.name} is listed twice")
        hosts.append(host)
    if not hosts:
        raise ConfigError(f"--hostfile: {path} lists no hosts; write one 'host slots=N' line per node")
    return hosts


def hostfile_text(hosts: list[Host]) -> str:
    return "".join(f"{h.name} slots={h.slots}\n" for h in hosts)
