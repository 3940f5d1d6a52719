"""Where C++ extensions a process of the suite compiles are kept: inside the virtual environment
it runs from (``TORCH_EXTENSIONS_DIR``), with that environment's own ninja.

torch's default cache, ``~/.cache/torch_extensions``, is shared by every environment of a user,
and a build made with another environment's torch, or by another ninja, is rebuilt: environments
(or ninjas) taking turns rebuilt DeepSpeed's shared-memory op at every turn, for 80-200 s each
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
    first on ``PATH``. Two ninjas (the environment's 1.13 and a system 1.11 here) hash a build's
    commands differently, so processes that found different ones on their PATH rebuilt each
    other's op every time. Outside a virtual environment torch's defaults stay."""
    if sys.prefix == sys.base_prefix:
        return
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(environment_cache(Path(sys.prefix))))
    tools = Path(sys.executable).parent
    path = os.environ.get("PATH", "")
    if (tools / "ninja").is_file() and path.split(os.pathsep)[0] != str(tools):
        os.environ["PATH"] = os.pathsep.join([str(tools), path]) if path else str(tools)


def environment_cache(prefix: Path) -> Path:
    """The extensions cache of the environment at ``prefix``. An environment reached through a
    link (a git worktree's ``.venv`` linked to the checkout's) compiles with include paths under
    the link, which the linked environment's own builds do not match: it gets a folder of its own,
    so that neither rebuilds the other's ops."""
    if not prefix.is_symlink():
        return prefix / "torch_extensions"
    return prefix / "torch_extensions" / f"via-{hashlib.sha256(str(prefix).encode()).hexdigest()[:12]}"
