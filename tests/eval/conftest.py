"""Fixtures for the evaluation harness: real g++, the real jail, the real HumanEval-X file."""

from __future__ import annotations

import dataclasses
import os
import socket
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from megacpp.eval import BuildOptions, CppVerifier, Limits, Sandbox, load_problems
from megacpp.eval.cpp import COMPILE_LIMITS
from megacpp.eval.sandbox import SANDBOX_UID

# Tight enough to keep the suite fast, loose enough for a loaded 2-core machine.
TEST_RUN_LIMITS = Limits(cpu_s=2, wall_s=8.0, memory_bytes=512 << 20, file_bytes=8 << 20,
                         tmp_bytes=32 << 20, output_bytes=64 << 10, processes=16)
TEST_COMPILE_LIMITS = COMPILE_LIMITS.replace(cpu_s=8, wall_s=20.0, memory_bytes=1 << 30)


@pytest.fixture(scope="session")
def problems():
    return load_problems()


@pytest.fixture(scope="session")
def problems_by_id(problems):
    return {problem.task_id: problem for problem in problems}


def with_run_limits(verifier: CppVerifier, **changes: object) -> CppVerifier:
    """A copy of ``verifier`` whose programs run under changed limits."""
    return dataclasses.replace(verifier, run_limits=verifier.run_limits.replace(**changes))


def make_verifier(isolation: str = "namespaces", **build: object) -> CppVerifier:
    return CppVerifier(BuildOptions(**build), Sandbox(isolation),
                       compile_limits=TEST_COMPILE_LIMITS, run_limits=TEST_RUN_LIMITS)


@pytest.fixture(scope="session")
def verifier() -> CppVerifier:
    return make_verifier()


@pytest.fixture(scope="session", params=["namespaces", "rlimits"])
def any_verifier(request) -> CppVerifier:
    """The same checks under both isolation levels (the fallback must contain them too)."""
    return make_verifier(request.param)


def sandbox_processes() -> list[int]:
    """Live (non-zombie) host pids of the sandbox uid (meaningful when the harness is root).

    Zombies are left out: they hold no resources, and without namespaces a killed program's
    zombie waits for the host's init to reap it."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        zombie = fields.get("State", "").strip().startswith("Z")
        if not zombie and fields.get("Uid", "").split()[:1] == [str(SANDBOX_UID)]:
            pids.append(int(entry.name))
    return pids


@dataclass
class Responsiveness:
    """Latencies (s) of starting a trivial subprocess on the host, sampled during some work."""

    latencies: list[float] = field(default_factory=list)

    @property
    def worst(self) -> float:
        return max(self.latencies)

    @property
    def median(self) -> float:
        return statistics.median(self.latencies)


@contextmanager
def sampling(sample: Callable[[], None], interval_s: float) -> Iterator[None]:
    """Call ``sample`` every ``interval_s`` in a background thread until the block ends."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            sample()
            stop.wait(interval_s)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@contextmanager
def measure_responsiveness(interval_s: float = 0.1) -> Iterator[Responsiveness]:
    """Sample `true`'s start-to-exit latency every ``interval_s`` until the block ends."""
    result = Responsiveness()

    def sample() -> None:
        started = time.monotonic()
        subprocess.run(["true"], check=True)
        result.latencies.append(time.monotonic() - started)

    with sampling(sample, interval_s):
        yield result


@dataclass
class HostShmem:
    """Peak growth of the host's shared memory (tmpfs, shmem) seen while some work ran."""

    baseline_kb: int
    peak_kb: int = 0

    @property
    def growth_bytes(self) -> int:
        return max(0, self.peak_kb - self.baseline_kb) * 1024


def _shmem_kb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1])
    raise AssertionError("/proc/meminfo has no Shmem line")


@contextmanager
def watch_host_shmem(interval_s: float = 0.02) -> Iterator[HostShmem]:
    """Sample the host's Shmem (every tmpfs page, in every mount namespace) until the block ends."""
    result = HostShmem(baseline_kb=_shmem_kb())
    result.peak_kb = result.baseline_kb

    def sample() -> None:
        result.peak_kb = max(result.peak_kb, _shmem_kb())

    with sampling(sample, interval_s):
        yield result


is_root = os.geteuid() == 0


@pytest.fixture
def loopback_server():
    """A real TCP server on 127.0.0.1 that records every connection it accepts."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    accepted: list[tuple] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, peer = server.accept()
            except TimeoutError:
                continue
            accepted.append(peer)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join()
    server.close()
