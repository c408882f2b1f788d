"""Walk source roots and yield C/C++ files as :class:`Document` s with provenance.

The walk is deterministic: roots in the order given, directory entries sorted by name,
depth first. A file is picked by extension (case-insensitive), or -- when it has no
extension at all -- by sniffing its first KiB (libstdc++'s ``vector``, ``map``...).

Nothing on disk is fatal. Each skipped entry is counted under a reason in the ``sources``
:class:`StageStats`: ``not_source``, ``excluded_dir``, ``symlink_skipped`` (when not
following symlinks), ``dangling_symlink``, ``symlink_loop``, ``duplicate_path`` (a file or
directory already walked through another path), ``special_file`` (FIFO, socket, device),
``unreadable`` (permission or I/O error), ``vanished`` (deleted mid-walk), ``too_large``
(over ``max_bytes``; such files are never read) and ``undecodable_path`` (a path that is not
valid UTF-8 cannot be recorded as provenance). A root that does not exist is a user error
(:class:`MegaCppError`), raised when :func:`iter_sources` is called.

A parquet or JSONL root is a table of documents, read by :mod:`megacpp.data.tables`.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import os
import re
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

from megacpp.data.config import CorpusConfig
from megacpp.data.document import Document
from megacpp.data.pipeline import StageStats
from megacpp.errors import MegaCppError

SNIFF_BYTES = 1024
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)  # a FIFO never blocks
# Content that marks an extensionless file as a C/C++ header: an Emacs C++ mode line,
# "#pragma once", an include guard, or an #include, at the start of a line.
_HEADER_SNIFF = re.compile(
    rb"-\*-\s*(?:mode:\s*)?c\+\+\s*-\*-"
    rb"|^[ \t]*#[ \t]*pragma[ \t]+once\b"
    rb"|^[ \t]*#[ \t]*ifndef[ \t]+\w+[ \t]*\r?\n[ \t]*#[ \t]*define[ \t]+\w+"
    rb"|^[ \t]*#[ \t]*include[ \t]*[<\"]",
    re.IGNORECASE | re.MULTILINE,
)


def looks_like_cpp_header(head: bytes) -> bool:
    """Whether the first bytes of an extensionless file say it is C/C++ source."""
    if b"\0" in head or head.startswith(b"#!"):
        return False
    return _HEADER_SNIFF.search(head) is not None


class _Skip(Exception):
    """An entry that is not yielded, with the reason it is counted under."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _reason_for(error: OSError) -> str:
    if error.errno == errno.ELOOP:
        return "symlink_loop"
    if isinstance(error, FileNotFoundError):
        return "vanished"
    return "unreadable"


_DirKey = tuple[int, int]  # (st_dev, st_ino)


class _Walker:
    """Depth-first, sorted walk (an explicit stack: depth is not bounded by recursion) with
    loop and duplicate protection."""

    def __init__(self, cfg: CorpusConfig, stats: StageStats) -> None:
        self.cfg = cfg
        self.stats = stats
        self.extensions = frozenset(cfg.extensions)
        self.seen_dirs: set[_DirKey] = set()
        self.seen_files: set[_DirKey] = set()
        nofollow = 0 if cfg.follow_symlinks else getattr(os, "O_NOFOLLOW", 0)
        self.open_flags = _OPEN_FLAGS | nofollow

    def walk(self, root: Path) -> Iterator[Document]:
        """Documents under one root (plain strings for paths: pathlib costs per file)."""
        if not root.is_dir():  # a single file: its directory is the source root
            doc = self._file(str(root), os.path.abspath(root.parent), root.name, explicit=True)
            if doc is not None:
                yield doc
            return
        source_root = os.path.abspath(root)
        prefix = len(os.path.join(str(root), ""))  # entry paths are root + "/" + relative
        listing = self._list_dir(str(root), ancestors=())
        stack = [listing] if listing is not None else []  # (entries left, ancestors)
        while stack:
            entries, ancestors = stack[-1]
            if not entries:
                stack.pop()
                continue
            entry = entries.pop()
            kind = self._kind(entry)
            if kind == "dir":
                listing = self._list_dir(entry.path, ancestors)
                if listing is not None:
                    stack.append(listing)
            elif kind == "file":
                doc = self._file(entry.path, source_root, entry.path[prefix:], explicit=False)
                if doc is not None:
                    yield doc

    def _skip(self, reason: str) -> None:
        self.stats.dropped[reason] += 1

    def _list_dir(
        self, directory: str, ancestors: tuple[_DirKey, ...]
    ) -> tuple[list[os.DirEntry[str]], tuple[_DirKey, ...]] | None:
        """The directory's entries in reverse name order (popped from the end) and the
        ancestors below it, or None when skipped (counted)."""
        try:
            st = os.stat(directory)
            key = (st.st_dev, st.st_ino)
            if key in ancestors:
                raise _Skip("symlink_loop")
            if key in self.seen_dirs:
                raise _Skip("duplicate_path")
            self.seen_dirs.add(key)
            with os.scandir(directory) as it:
                entries = sorted(it, key=lambda e: e.name, reverse=True)
        except _Skip as skip:
            self._skip(skip.reason)
            return None
        except OSError as error:
            self._skip(_reason_for(error))
            return None
        return entries, (*ancestors, key)

    def _kind(self, entry: os.DirEntry[str]) -> str:
        """``"dir"`` to descend, ``"file"`` to consider, ``"skipped"`` (counted)."""
        try:
            if entry.is_symlink():
                if not self.cfg.follow_symlinks:
                    raise _Skip("symlink_skipped")
                if not os.path.exists(entry.path):  # target missing, or a loop of links
                    raise _Skip(_broken_link_reason(entry.path))
            if not entry.is_dir():
                return "file"
            if entry.name in self.cfg.exclude_dirs:
                raise _Skip("excluded_dir")
            return "dir"
        except _Skip as skip:
            self._skip(skip.reason)
        except OSError as error:
            self._skip(_reason_for(error))
        return "skipped"

    def _file(
        self, path: str, source_root: str, rel_path: str, *, explicit: bool
    ) -> Document | None:
        """Select and read one file (``explicit``: named as a root, so always selected)."""
        self.stats.seen += 1
        if not _is_utf8(source_root) or not _is_utf8(rel_path):
            self._skip("undecodable_path")
            return None
        suffix = os.path.splitext(os.path.basename(path))[1].lower()
        sniff = not explicit and not suffix and self.cfg.detect_extensionless_headers
        if not explicit and suffix not in self.extensions and not sniff:
            self._skip("not_source")
            return None
        # A root named explicitly may itself be a symlink: follow it whatever the setting.
        flags = _OPEN_FLAGS if explicit else self.open_flags
        try:
            raw = self._read(path, flags, sniff=sniff)
        except _Skip as skip:
            self._skip(skip.reason)
            return None
        except OSError as error:
            self._skip(_reason_for(error))
            return None
        self.stats.kept += 1
        self.stats.bytes_out += len(raw)
        return Document(
            source_root=source_root,
            rel_path=rel_path,
            size=len(raw),
            sha256=hashlib.sha256(raw).hexdigest(),
            raw=raw,
        )

    def _read(self, path: str, flags: int, *, sniff: bool) -> bytes:
        fd = os.open(path, flags)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _Skip("special_file")
            self.stats.bytes_in += st.st_size
            key = (st.st_dev, st.st_ino)
            if key in self.seen_files:
                raise _Skip("duplicate_path")
            if st.st_size > self.cfg.max_bytes:
                raise _Skip("too_large")
            head = os.read(fd, SNIFF_BYTES)
            if sniff and not looks_like_cpp_header(head):
                raise _Skip("not_source")
            self.seen_files.add(key)
            return head + _read_rest(fd, self.cfg.max_bytes + 1 - len(head))
        finally:
            os.close(fd)


def _is_utf8(path: str) -> bool:
    """False for names with undecodable bytes (os.fsdecode turns them into surrogates)."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _broken_link_reason(path: str) -> str:
    try:
        os.stat(path)
    except OSError as error:
        return "symlink_loop" if error.errno == errno.ELOOP else "dangling_symlink"
    return "vanished"


def _read_rest(fd: int, limit: int) -> bytes:
    """Everything after the head, at most ``limit`` bytes (a file growing mid-read beyond
    ``max_bytes`` is caught by the size filter, never read without bound)."""
    chunks, remaining = [], limit
    while remaining > 0:
        chunk = os.read(fd, min(remaining, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def check_roots(roots: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """``roots`` as paths, each an existing directory or regular file (else MegaCppError); a
    parquet or JSONL root is also checked as a document table."""
    from megacpp.data import tables  # it uses looks_like_cpp_header from here

    paths = [Path(root) for root in roots]
    if not paths:
        raise MegaCppError("no source roots given: name at least one directory or file")
    for path in paths:
        if not path.exists():
            raise MegaCppError(
                f"source root {str(path)!r} does not exist (expected a directory or file)"
            )
        if not (path.is_dir() or path.is_file()):
            raise MegaCppError(f"source root {str(path)!r} is not a directory or regular file")
        if path.is_file() and tables.is_table(path):
            tables.check_table(path)
    return paths


def iter_sources(
    roots: Sequence[str | os.PathLike[str]], cfg: CorpusConfig, stats: StageStats
) -> Iterator[Document]:
    """Every C/C++ file under ``roots`` (directories or single files), lazily, in walk order;
    a parquet or JSONL root yields one document per row (:mod:`megacpp.data.tables`).

    ``stats`` (conventionally named ``sources``) counts files seen, kept, bytes and every
    skip reason. Raises :class:`MegaCppError` at call time if a root is missing or not a
    regular file/directory.
    """
    from megacpp.data import tables

    paths = check_roots(roots)
    walker = _Walker(cfg, stats)

    def documents(path: Path) -> Iterator[Document]:
        if path.is_file() and tables.is_table(path):
            return tables.iter_table(path, cfg, stats, walker.extensions)
        return walker.walk(path)

    return itertools.chain.from_iterable(documents(path) for path in paths)
