"""Compile a small native source once per source version and cache the result.

Used for the sandbox launcher (``eval/jail.c``) and the encoder's pre-tokenizer
(``data/pretokenize.cpp``). The output is keyed by the source's hash and built atomically
(a temporary file renamed into place), so concurrent processes never load half a file. The
cache lives under :func:`cache_dir` (``$MEGACPP_CACHE_DIR``, else ``$XDG_CACHE_HOME/megacpp``,
else ``~/.cache/megacpp``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

from megacpp._io import sha256_bytes
from megacpp.errors import MegaCppError

_build_lock = threading.Lock()


def cache_dir() -> Path:
    """Per-user cache root for compiled helpers (and the sandbox's precompiled headers)."""
    explicit = os.environ.get("MEGACPP_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "megacpp"


def compiled(
    source: Path, subdir: str, stem: str, compilers: Sequence[str], flags: Sequence[str],
    what: str, error: type[MegaCppError] = MegaCppError,
) -> Path:
    """Path of ``source`` compiled with the first of ``compilers`` on PATH and ``flags``
    (``-o OUT`` and the source are appended), building it on first use. Raises ``error``
    naming ``what`` when the source is missing, no compiler is found, or the build fails."""
    if not source.is_file():
        raise error(f"the {what} source {source} is missing from the install")
    suffix = ".so" if "-shared" in flags else ""
    target = cache_dir() / subdir / f"{stem}-{sha256_bytes(source.read_bytes())[:16]}{suffix}"
    with _build_lock:
        if not target.is_file():
            _build(source, target, compilers, flags, what, error)
    return target


def _build(source: Path, target: Path, compilers: Sequence[str], flags: Sequence[str],
           what: str, error: type[MegaCppError]) -> None:
    compiler = next((found for c in compilers if (found := shutil.which(c))), None)
    if compiler is None:
        raise error(f"no compiler ({' or '.join(compilers)}) on PATH to build the {what}; "
                    "install one (Debian: apt-get install g++)")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, "-o", tmp, str(source)], capture_output=True,
                              text=True, timeout=180, check=False)
        if done.returncode != 0:
            raise error(f"building the {what} with {compiler} failed:\n{done.stderr.strip()}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
