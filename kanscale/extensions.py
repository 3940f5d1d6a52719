"""Where C++ extensions a process of the suite compiles are kept: inside the virtual environment
it runs from (``TORCH_EXTENSIONS_DIR``), with that environment's own ninja. This is the suite's one
policy for what it compiles (the fused B-spline op, kan_models/fused/build.py, and what DeepSpeed
builds): a build belongs to the torch it is compiled against, so it lives with that environment.
What the suite measures about the machine lives in ``$KANSCALE_CACHE_DIR`` instead
(kan_models/sparse_crossover.py).

torch's default cache, ``~/.cache/torch_extensions``, is shared by every environment of a user,
and a build made with another environment's torch, or by another ninja, is rebuilt: environments
(or ninjas) taking turns rebuilt DeepSpeed's shared-memory op at every turn
(the suite no longer builds that op: strategies/backends/deepspeed.py, ``prepare_import``).
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path


def keep_builds_in_environment() -> None:
    """In a virtual environment, for this process and the ranks it starts (they inherit both):
    ``TORCH_EXTENSIONS_DIR`` inside it where unset, and its own ``ninja`` (a DeepSpeed dependency)
    first on ``PATH``. Two ninjas (the environment's and an older system one) hash a build's
    commands differently, so processes that found different ones on their PATH rebuilt each
    other's op every time. Outside a virtual environment torch's defaults stay."""
    if sys.prefix == sys.base_prefix:
        return
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(environment_cache(Path(sys.prefix))))
    tools = Path(sys.executable).parent
    path = os.environ.get("PATH", "")
    if (tools / "ninja").is_file() and path.split(os.pathsep)[0] != str(tools):
        os.environ["PATH"] = os.pathsep.join([str(tools), path]) if path else str(tools)


def extensions_dir() -> Path:
    """Where this process compiles C++ extensions: ``$TORCH_EXTENSIONS_DIR`` where set (the
    entry point and the Makefile set it), else the virtual environment's folder, else torch's
    own default (``~/.cache/torch_extensions``)."""
    if folder := os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(folder)
    if sys.prefix != sys.base_prefix:
        return environment_cache(Path(sys.prefix))
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def environment_cache(prefix: Path) -> Path:
    """The extensions cache of the environment at ``prefix``. An environment reached through a
    link (a git worktree's ``.venv`` linked to the checkout's) compiles with include paths under
    the link, which the linked environment's own builds do not match: it gets a folder of its own,
    so that neither rebuilds the other's ops."""
    if not prefix.is_symlink():
        return prefix / "torch_extensions"
    return prefix / "torch_extensions" / f"via-{hashlib.sha256(str(prefix).encode()).hexdigest()[:12]}"
