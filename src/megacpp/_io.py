"""Small file helpers shared by every layer: atomic writes and content hashes.

Atomic means: write to a temporary file in the same directory, fsync, then ``os.replace``.
A reader never sees a half-written file; a crash leaves the old file (or none).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes 0600; results are meant to be shared
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_path(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike[str], obj: Any, *, indent: int = 2) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=False) + "\n")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Flush a file's data, or a directory's entries (renames, new files), to the disk.

    A file that cannot be synced raises. A directory that cannot be opened or synced is
    skipped: some filesystems refuse to fsync directories, and the rename is done either
    way."""
    path = Path(path)
    directory = path.is_dir()
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if directory:
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not directory:
            raise
    finally:
        os.close(fd)
