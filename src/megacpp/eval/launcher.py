"""Build and locate ``megacpp-jail``, the small C launcher every sandboxed process goes through.

The launcher (``jail.c`` next to this file) does what Python cannot do safely from a
threaded process: enter namespaces, build a private root filesystem, drop privileges, set
rlimits and exec -- all between ``fork`` and ``exec``, with no Python code in the child. It is
compiled once per source version with the system C compiler and cached under
:func:`cache_dir` (``$MEGACPP_CACHE_DIR``, else ``$XDG_CACHE_HOME/megacpp``, else
``~/.cache/megacpp``).
"""

from __future__ import annotations

from pathlib import Path

from megacpp._build import cache_dir, compiled
from megacpp.errors import MegaCppError

__all__ = ["JAIL_SOURCE", "SandboxError", "cache_dir", "jail_binary"]

JAIL_SOURCE = Path(__file__).with_name("jail.c")
_CFLAGS = ("-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror")


class SandboxError(MegaCppError):
    """The sandbox itself could not be built or started (never a verdict on a program)."""


def jail_binary() -> Path:
    """Path of the compiled launcher, building it on first use (keyed by its source hash)."""
    return compiled(JAIL_SOURCE, "sandbox", "megacpp-jail", ("cc", "gcc"), _CFLAGS,
                    "sandbox launcher", SandboxError)
