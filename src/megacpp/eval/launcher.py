"""Build and locate ``megacpp-jail``, the small C launcher every sandboxed process goes through.

The launcher (``jail.c`` next to this file) does what Python cannot do safely from a
threaded process: enter namespaces, build a private root filesystem, drop privileges, set
rlimits and exec -- all between ``fork`` and ``exec``, with no Python code in the child. It is
compiled once per source version with the system C compiler and cached under
:func:`cache_dir` (``$MEGACPP_CACHE_DIR``, else ``$XDG_CACHE_HOME/megacpp``, else
``~/.cache/megacpp``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from megacpp._io import sha256_bytes
from megacpp.errors import MegaCppError

JAIL_SOURCE = Path(__file__).with_name("jail.c")
_CFLAGS = ("-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror")
_build_lock = threading.Lock()


class SandboxError(MegaCppError):
    """The sandbox itself could not be built or started (never a verdict on a program)."""


def cache_dir() -> Path:
    """Per-user cache root for the launcher binary and precompiled headers."""
    explicit = os.environ.get("MEGACPP_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "megacpp"


def jail_binary() -> Path:
    """Path of the compiled launcher, building it on first use (keyed by its source hash)."""
    if not JAIL_SOURCE.is_file():
        raise SandboxError(f"the sandbox launcher source {JAIL_SOURCE} is missing from the install")
    source = JAIL_SOURCE.read_bytes()
    target = cache_dir() / "sandbox" / f"megacpp-jail-{sha256_bytes(source)[:16]}"
    with _build_lock:
        if not os.access(target, os.X_OK):
            _build(target)
    return target


def _build(target: Path) -> None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SandboxError(
            "no C compiler (cc or gcc) on PATH to build the sandbox launcher; "
            "install gcc (Debian: apt-get install g++)"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *_CFLAGS, "-o", tmp, str(JAIL_SOURCE)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if done.returncode != 0:
            raise SandboxError(
                f"building the sandbox launcher with {compiler} failed:\n{done.stderr.strip()}"
            )
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
