"""DeepSpeed/MPI-style hostfiles: one ``host slots=N`` line per node.

A hostfile is read by DeepSpeed's own parser, so that what ``kanscale run`` accepts is exactly
what the deepspeed launcher will accept (``worker-0.svc slots=2 max_slots=2`` is fine,
``node0 slots = 2`` is not). The suite adds the checks of its own: every node has at least one
slot, and the same number (the record's ranks per node); and every host is a host name or an IP
address, since host names go on to ssh, pdsh and the nodes' shells (``-oProxyCommand=...`` is an
ssh option, ``a;b`` a command).
"""

from __future__ import annotations

import ipaddress
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from kanscale.errors import ConfigError
from strategies.backends.deepspeed import prepare_import

# RFC 1123: dot-separated labels of letters, digits and hyphens, no label starting or ending with
# a hyphen, at most 63 characters a label and 253 in all
LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def check_host_name(name: str, field: str) -> None:
    """Refuse ``name`` unless it is an RFC 1123 host name or an IPv4/IPv6 address."""
    try:
        ipaddress.ip_address(name)
        return
    except ValueError:
        pass
    if len(name) <= 253 and all(LABEL.fullmatch(label) for label in name.removesuffix(".").split(".")):
        return
    raise ConfigError(
        f"{field}: {name!r} is not a host name (dot-separated labels of letters, digits and hyphens, "
        "none starting or ending with a hyphen, at most 63 characters each) or an IP address; "
        "give the nodes' names or addresses, e.g. node1,node2 or 10.0.0.1,10.0.0.2"
    )


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


def parse_hostfile(path: str | Path, device_type: str = "cpu") -> list[Host]:
    """Read a hostfile as DeepSpeed does (``device_type`` is where the ranks run: DeepSpeed picks
    its accelerator on import); an error names the file, the line DeepSpeed refused and the fix."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--hostfile: {path} does not exist; write one 'host slots=N' line per node")
    prepare_import(device_type)
    from deepspeed.launcher.runner import fetch_hostfile
    from deepspeed.utils import logger

    level = logger.level
    logger.setLevel(logging.CRITICAL)  # it logs the whole file before raising; the error below says it better
    try:
        pool = fetch_hostfile(str(path))
    except ValueError as err:
        raise ConfigError(
            f"--hostfile: {path}: DeepSpeed refuses it: {str(err).rstrip('.')}; write one 'host slots=N' line per node "
            "('#' starts a comment line)"
        ) from None
    finally:
        logger.setLevel(level)
    hosts = [Host(name, slots) for name, slots in pool.items()]
    for host in hosts:
        check_host_name(host.name, f"--hostfile: {path}")
        if host.slots < 1:
            raise ConfigError(
                f"--hostfile: {path}: host {host.name} has slots={host.slots}; every node needs at least one"
            )
    slots = sorted({h.slots for h in hosts})
    if len(slots) > 1:
        raise ConfigError(
            f"--hostfile: {path}: every host needs the same number of slots (ranks per node), got {slots}"
        )
    return hosts


def hostfile_text(hosts: list[Host]) -> str:
    return "".join(f"{h.name} slots={h.slots}\n" for h in hosts)
