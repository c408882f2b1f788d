"""Small file helpers shared by every layer: atomic writes, content hashes and bounded reads
of user-supplied files.

Atomic means: write to a temporary file in the same directory, fsync, then ``os.replace``.
A reader never sees a half-written file; a crash leaves the old file (or none).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
import tomllib
from pathlib import Path
from typing import Any

from megacpp.errors import MegaCppError

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


# -- bounded reading of user-supplied files --------------------------------------------------------
# Every file a user names (a config, a receipt, a prompt, a marker...) is read through these:
# a size bound, regular files only (a FIFO, /dev/zero or a directory is refused before a byte is
# read), and one MegaCppError line naming the file for every way it can fail.

KiB, MiB = 1 << 10, 1 << 20
CONFIG_LIMIT = 4 * MiB  # TOML configs and presets, dataset and checkpoint markers
JSON_LIMIT = 64 * MiB  # receipts, fingerprints, manifests, trainer state, router models
TEXT_LIMIT = 16 * MiB  # prompt files, C++ sources for `eval run`, `tokenizer encode --file`
TOKENIZER_LIMIT = 256 * MiB  # tokenizer.json
LOG_LIMIT = 512 * MiB  # metrics.jsonl, samples files

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR,
          "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def describe_size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes} bytes"


def read_bounded(path: str | os.PathLike[str], limit: int, *, what: str = "file",
                 error: type[MegaCppError] = MegaCppError) -> bytes:
    """The bytes of regular file ``path``, at most ``limit`` of them; ``error`` (one line naming
    ``what`` and the path) when it is missing, not a regular file, unreadable or larger."""
    try:
        # O_NONBLOCK: opening a FIFO does not wait for a writer (it is refused just below)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise error(f"{what} {os.fspath(path)} does not exist") from None
    except OSError as exc:
        raise error(f"cannot read {what} {os.fspath(path)}: {exc.strerror or exc}") from None
    except ValueError:  # a NUL character in the path
        raise error(f"{what} {os.fspath(path)!r}: a path cannot contain a NUL character") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        raise error(f"{what} {os.fspath(path)} is {kind}; expected a regular file")
    with os.fdopen(fd, "rb", buffering=0) as f:
        try:
            data = f.read(limit + 1)  # /proc files report size 0: read to find out
        except OSError as exc:
            raise error(f"cannot read {what} {os.fspath(path)}: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise error(f"{what} {os.fspath(path)} is larger than {describe_size(limit)}; "
                    "refusing to read it")
    return data


def decode_utf8(data: bytes, where: str, *, error: type[MegaCppError] = MegaCppError) -> str:
    """``data`` as UTF-8 text; ``error`` naming ``where`` and the first bad byte otherwise."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{where} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
                    f"{exc.start})") from None


def read_text_bounded(path: str | os.PathLike[str], limit: int, *, what: str = "file",
                      error: type[MegaCppError] = MegaCppError) -> str:
    """:func:`read_bounded`, decoded as UTF-8 (a non-UTF-8 file is ``error``)."""
    data = read_bounded(path, limit, what=what, error=error)
    return decode_utf8(data, f"{what} {os.fspath(path)}", error=error)


def read_json_bounded(path: str | os.PathLike[str], limit: int = JSON_LIMIT, *,
                      what: str = "file", error: type[MegaCppError] = MegaCppError) -> Any:
    """:func:`read_text_bounded`, parsed as JSON (invalid JSON is ``error``)."""
    text = read_text_bounded(path, limit, what=what, error=error)
    return parse_json(text, f"{what} {os.fspath(path)}", error=error)


def parse_json(text: str | bytes, where: str, *,
               error: type[MegaCppError] = MegaCppError) -> Any:
    """``json.loads(text)``; ``error`` naming ``where`` for malformed, too deeply nested or
    too long-numbered JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{where}: not valid JSON ({exc.msg} at line {exc.lineno}, column "
                    f"{exc.colno}); it may be truncated or corrupt") from None
    except UnicodeDecodeError as exc:
        raise error(f"{where} is not UTF-8 text (offset {exc.start})") from None
    except (ValueError, RecursionError) as exc:  # a 5000-digit integer, [[[[...]]]] nesting
        raise error(f"{where}: not usable JSON ({str(exc).splitlines()[0][:120]})") from None


def read_toml_bounded(path: str | os.PathLike[str], limit: int = CONFIG_LIMIT, *,
                      what: str = "config", error: type[MegaCppError] = MegaCppError,
                      ) -> dict[str, Any]:
    """:func:`read_text_bounded`, parsed as TOML (invalid TOML is ``error``)."""
    text = read_text_bounded(path, limit, what=what, error=error)
    return parse_toml_text(text, f"{what} {os.fspath(path)}", error)


def parse_toml_text(text: str, source: str, error: type[MegaCppError] = MegaCppError,
                    ) -> dict[str, Any]:
    """``text`` parsed as TOML; ``source`` (a path or a preset's name) starts the ``error``."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{source} is not valid TOML ({exc})") from None
    except (ValueError, RecursionError) as exc:  # 5000-digit integers, deep nesting
        raise error(f"{source} is not usable TOML ({str(exc).splitlines()[0][:120]})") from None
