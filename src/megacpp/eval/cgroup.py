"""One memory cgroup per sandboxed run: a bound that counts everything the run holds.

``RLIMIT_AS`` bounds each process's address space, but not the sum over a run's processes,
nor memory a run keeps outside any address space: files in a tmpfs, page cache, kernel
buffers. A memory cgroup charges all of it to the run. Each run gets a child cgroup of the
base found by :func:`megacpp.contract.sandbox_host.find_memory_cgroup` (cgroup v2:
``memory.max`` and ``memory.swap.max = 0``; v1: ``memory.limit_in_bytes`` and, where swap is
accounted, ``memory.memsw.limit_in_bytes``). The jail's launcher moves itself into it before
it builds anything, so every process of the run is inside; when the limit is reached and
nothing can be reclaimed, the kernel's OOM killer ends a process of the run (the program
first: it runs with ``oom_score_adj = 1000``) and the verdict is ``memory_limit``.

Where no such cgroup can be created, the sandbox falls back to per-process limits (see
``docs/eval.md``) and says so in every verdict and receipt.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from megacpp.contract.sandbox_host import MemoryCgroupBase
from megacpp.eval.launcher import SandboxError

RUN_PREFIX = "megacpp-run-"
_REMOVE_TIMEOUT_S = 5.0
_counter = itertools.count()


@dataclass(frozen=True)
class RunCgroup:
    """The cgroup of one run; :meth:`remove` kills what is left in it and deletes it."""

    version: int
    path: Path
    limit_bytes: int

    def oom_kills(self) -> int:
        """How many processes of this run the cgroup's OOM killer ended."""
        if self.version == 2:
            return _field(self.path / "memory.events", "oom_kill")
        return _field(self.path / "memory.oom_control", "oom_kill")

    def remove(self) -> None:
        """SIGKILL every process still in the cgroup (a program that escaped its process
        group), then delete the cgroup; processes killed a moment ago may still be exiting."""
        deadline = time.monotonic() + _REMOVE_TIMEOUT_S
        while True:
            self._kill_all()
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise SandboxError(f"cannot remove the run's cgroup {self.path}: {exc}") from None
            time.sleep(0.01)

    def _kill_all(self) -> None:
        if self.version == 2 and (self.path / "cgroup.kill").exists():
            _write(self.path / "cgroup.kill", "1")  # kernel >= 5.14: the whole subtree at once
            return
        for pid in _pids(self.path / "cgroup.procs"):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


class MemoryCgroups:
    """Creates the per-run cgroups under one base directory."""

    def __init__(self, base: MemoryCgroupBase) -> None:
        self.base = base
        self._prefix = f"{RUN_PREFIX}{os.getpid()}-"
        _remove_stale(base.path)

    @property
    def version(self) -> int:
        return self.base.version

    def create(self, limit_bytes: int) -> RunCgroup:
        """A fresh cgroup limited to ``limit_bytes`` of memory, swap included."""
        path = self.base.path / f"{self._prefix}{next(_counter)}"
        try:
            path.mkdir()
        except OSError as exc:
            raise SandboxError(f"cannot create the run's cgroup {path}: {exc}") from None
        run = RunCgroup(self.base.version, path, limit_bytes)
        try:
            if self.base.version == 2:
                _write(path / "memory.max", str(limit_bytes))
                _write_if_present(path / "memory.swap.max", "0")
            else:
                _write(path / "memory.limit_in_bytes", str(limit_bytes))
                _write_if_present(path / "memory.memsw.limit_in_bytes", str(limit_bytes))
        except OSError as exc:
            run.remove()
            raise SandboxError(f"cannot set the memory limit of cgroup {path}: {exc}") from None
        return run

    def probe(self) -> None:
        """Create and remove one limited cgroup; raise :class:`SandboxError` if that fails."""
        self.create(64 << 20).remove()


def _remove_stale(base: Path) -> None:
    """Delete empty run cgroups left by harness processes that no longer exist."""
    try:
        entries = list(base.glob(f"{RUN_PREFIX}*-*"))
    except OSError:
        return
    for entry in entries:
        owner = entry.name.removeprefix(RUN_PREFIX).split("-", 1)[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            try:
                entry.rmdir()
            except OSError:
                pass


def _field(path: Path, name: str) -> int:
    """The value of ``name`` in a flat-keyed cgroup file such as memory.events."""
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _pids(path: Path) -> list[int]:
    try:
        return [int(line) for line in path.read_text().split()]
    except (OSError, ValueError):
        return []


def _write(path: Path, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


def _write_if_present(path: Path, text: str) -> None:
    """Swap limits exist only where the kernel accounts swap (v1 needs ``swapaccount=1``);
    without one, pages the run swaps out are not counted (docs/eval.md)."""
    if path.exists():
        _write(path, text)
