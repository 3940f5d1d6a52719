"""The rendezvous port: which one a launch uses, and whether it is free.

Where every rank starts on this machine the suite controls the rendezvous and takes a port
nothing listens on, so two runs side by side never collide. Where nodes are started one by one
(one ``kanscale run`` per node) they must agree on it without talking, so it is fixed: the
``--master-port`` given, else the cluster's ``MASTER_PORT``, else 29500 as torch's own default.
"""

from __future__ import annotations

import errno
import os
import socket

from kanscale.errors import ConfigError

DEFAULT_PORT = 29500  # torch.distributed's (and DeepSpeed's and Accelerate's) default


def free_port() -> int:
    """A TCP port nothing on this machine listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment_port() -> int | None:
    """``MASTER_PORT`` as the environment (a cluster, a job script) exports it, if it does."""
    value = os.environ.get("MASTER_PORT", "").strip()
    if not value:
        return None
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise ConfigError(
            f"MASTER_PORT={value!r} in the environment is not a port number; export a number from 1 "
            "to 65535, unset it, or pass --master-port"
        )
    return int(value)


def rendezvous_port(every_node_here: bool) -> tuple[int, str]:
    """The port where none is given, and where it came from: ``MASTER_PORT``, else a free port
    where ``every_node_here``, else :data:`DEFAULT_PORT`."""
    from_environment = environment_port()
    if from_environment is not None:
        return from_environment, "MASTER_PORT in the environment"
    if every_node_here:
        return free_port(), "a free port"
    return DEFAULT_PORT, "the default"


def check_port_free(port: int, source: str) -> None:
    """Refuse a rendezvous port that something on this machine already listens on: the launch
    would otherwise fail after starting, with EADDRINUSE deep in a rank's traceback."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is still usable
        try:
            s.bind(("", port))
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                raise
            raise ConfigError(
                f"--master-port: port {port} ({source}) is already in use on this machine, perhaps by "
                "another run; pass a free --master-port (or unset MASTER_PORT and leave the option out: "
                "then kanscale picks a free port where every rank starts here)"
            ) from None
