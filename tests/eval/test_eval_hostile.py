"""Hostile and broken programs: each is contained, classified correctly, and the host stays
responsive. Real g++, real jail, real sockets and files; nothing is mocked."""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from megacpp.contract.sandbox_host import find_memory_cgroup
from megacpp.eval import Status
from tests.eval.conftest import (
    TEST_COMPILE_LIMITS,
    TEST_RUN_LIMITS,
    is_root,
    make_verifier,
    measure_responsiveness,
    sandbox_processes,
    watch_host_shmem,
    with_run_limits,
)
from tests.eval.hostile_programs import (
    ALLOCATE_64_GB,
    BUSY_LOOP,
    CONNECT,
    ENDLESS_STDERR,
    ENDLESS_STDOUT,
    ESCAPE_ATTEMPT,
    ESCAPE_VARIANTS,
    FILL_TMP,
    FORK_BOMB,
    GROW_UNTIL_REFUSED,
    INCLUDE_DEV_ZERO,
    MOUNT_TMPFS_ESCAPE,
    NESTED_USERNS_FORK_BOMB,
    ORDINARY_PROCESSES,
    READ_OUTSIDE,
    SIGNAL_HOST,
    SLEEPER,
    TEMPLATE_BOMB,
    WRITE_10_GB_FILE,
    WRITE_OUTSIDE,
    c_strings,
)

# Spawning `true` takes a few ms on an idle host; a starved host takes seconds.
MAX_LATENCY_S = 1.5


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """After every hostile program, nothing may still run as the sandbox uid."""
    yield
    if not is_root:
        return
    deadline = time.monotonic() + 5
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes() == []


def test_fork_bomb_is_contained_and_the_host_stays_responsive(any_verifier):
    with measure_responsiveness() as host:
        verdict = with_run_limits(any_verifier, cpu_s=1, wall_s=3.0).verify(FORK_BOMB)
    assert verdict.status is Status.TIMEOUT, verdict
    assert host.worst < MAX_LATENCY_S, host.latencies


@pytest.mark.skipif(not is_root, reason="counts the sandbox uid's processes on the host")
def test_a_fork_bomb_from_nested_user_namespaces_stays_within_the_process_limit(verifier):
    peak, stop = [0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], len(sandbox_processes()))
            stop.wait(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        verdict = with_run_limits(verifier, cpu_s=1, wall_s=2.5).verify(NESTED_USERNS_FORK_BOMB)
    finally:
        stop.set()
        watcher.join()
    assert verdict.status is Status.TIMEOUT, verdict
    assert 1 < peak[0] <= TEST_RUN_LIMITS.processes


def test_infinite_loop_times_out_on_cpu_and_the_host_stays_responsive(any_verifier):
    with measure_responsiveness() as host:
        verdict = with_run_limits(any_verifier, cpu_s=1).verify(BUSY_LOOP)
    assert verdict.status is Status.TIMEOUT, verdict
    assert host.worst < MAX_LATENCY_S, host.latencies


def test_a_sleeping_program_is_killed_at_the_wall_clock_deadline(verifier):
    started = time.monotonic()
    verdict = with_run_limits(verifier, wall_s=1.5).verify(SLEEPER)
    elapsed = time.monotonic() - started
    assert verdict.status is Status.TIMEOUT, verdict
    assert "wall-clock" in verdict.detail
    assert elapsed < 1.5 + TEST_COMPILE_LIMITS.wall_s


def test_growing_allocations_hit_the_memory_limit(any_verifier):
    verdict = any_verifier.verify(GROW_UNTIL_REFUSED)
    assert verdict.status is Status.MEMORY_LIMIT, verdict
    assert "bad_alloc" in verdict.stderr
    # it really grew, up to (not past) the limit
    assert TEST_RUN_LIMITS.memory_bytes // 2 < verdict.max_rss_kb * 1024
    assert verdict.max_rss_kb * 1024 <= TEST_RUN_LIMITS.memory_bytes


def test_a_64_gb_request_is_refused_without_being_called_a_memory_limit(any_verifier):
    """Refused at once with a few MiB in use: the limit was never reached, and the uncaught
    std::bad_alloc is the program's own failure."""
    verdict = any_verifier.verify(ALLOCATE_64_GB)
    assert verdict.status is Status.FAILED, verdict
    assert "allocated" not in verdict.stdout
    assert verdict.detail.startswith("uncaught exception of type std::bad_alloc"), verdict.detail
    assert "below 25% of the 512.0 MiB limit" in verdict.detail


def test_a_10_gb_file_is_stopped_at_the_file_size_limit(any_verifier):
    verdict = any_verifier.verify(WRITE_10_GB_FILE)
    assert verdict.status is Status.OUTPUT_LIMIT, verdict
    assert verdict.signal == "SIGXFSZ"  # the kernel stopped it at RLIMIT_FSIZE (8 MiB)


@pytest.mark.parametrize("program", [ENDLESS_STDOUT, ENDLESS_STDERR], ids=["stdout", "stderr"])
def test_endless_output_is_cut_at_the_output_limit(any_verifier, program):
    verdict = any_verifier.verify(program)
    assert verdict.status is Status.OUTPUT_LIMIT, verdict
    kept = len(verdict.stdout) + len(verdict.stderr)
    assert kept < 2 * TEST_RUN_LIMITS.output_bytes


def test_writes_outside_the_sandbox_do_not_reach_the_host(verifier, tmp_path):
    token = f"megacpp_escape_{os.getpid()}_{time.monotonic_ns()}"
    targets = [Path.home() / token, Path("/tmp") / token, tmp_path / token,
               Path("/etc") / token, Path("/usr") / token]
    verdict = verifier.verify(WRITE_OUTSIDE.replace("PATHS", c_strings(targets)))
    assert verdict.status is Status.PASSED, verdict
    for target in targets:
        assert not target.exists(), f"{target} was written from inside the sandbox"


def test_files_outside_the_sandbox_cannot_be_read(any_verifier, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("do not read me")
    secret.chmod(0o600)
    tmp_path.chmod(0o755)
    verdict = any_verifier.verify(READ_OUTSIDE.replace("PATHS", c_strings([secret, "/etc/shadow"])))
    assert verdict.status is Status.PASSED, verdict.stdout
    assert "READ" in verdict.stdout  # its own binary, and only that
    assert verdict.stdout.count("READ") == 1


def test_the_network_is_unreachable(verifier, loopback_server):
    port, accepted = loopback_server
    probe = socket.create_connection(("127.0.0.1", port))  # the server itself works
    probe.close()
    time.sleep(0.3)
    assert len(accepted) == 1
    verdict = verifier.verify(CONNECT.replace("PORT", str(port)))
    assert verdict.status is Status.PASSED, verdict.stdout
    assert "Network is unreachable" in verdict.stdout
    time.sleep(0.3)
    assert len(accepted) == 1, "the sandboxed program reached the loopback server"


def test_host_processes_cannot_be_signalled(any_verifier):
    verdict = any_verifier.verify(SIGNAL_HOST.replace("HOST_PID", str(os.getpid())))
    assert verdict.status is Status.PASSED, verdict.stdout


@pytest.mark.parametrize("program", [TEMPLATE_BOMB, INCLUDE_DEV_ZERO], ids=["template", "dev_zero"])
def test_compiler_bombs_end_as_compile_errors_without_hanging(verifier, program):
    small = dataclasses.replace(verifier, compile_limits=TEST_COMPILE_LIMITS.replace(
        memory_bytes=512 << 20))
    with measure_responsiveness() as host:
        started = time.monotonic()
        verdict = small.verify(program)
        elapsed = time.monotonic() - started
    assert verdict.status is Status.COMPILE_ERROR, verdict
    assert elapsed < TEST_COMPILE_LIMITS.wall_s + 5
    assert host.worst < MAX_LATENCY_S, host.latencies


def test_a_tmpfs_of_its_own_cannot_be_mounted_to_escape_the_memory_limit(any_verifier):
    """unshare(user + mount) is refused, so no tmpfs outside the jail's caps ever exists."""
    with watch_host_shmem() as shmem:
        verdict = any_verifier.verify(MOUNT_TMPFS_ESCAPE)
    assert verdict.status is Status.FAILED, verdict
    assert "unshare: Operation not permitted" in verdict.stderr
    assert "wrote" not in verdict.stdout
    assert shmem.growth_bytes < TEST_RUN_LIMITS.run_memory_bytes(), shmem


@pytest.mark.parametrize("name", sorted(ESCAPE_VARIANTS))
def test_namespace_and_mount_calls_are_refused(any_verifier, name):
    attempt, errno_text = ESCAPE_VARIANTS[name]
    verdict = any_verifier.verify(ESCAPE_ATTEMPT.replace("ATTEMPT", attempt))
    assert verdict.status is Status.PASSED, verdict  # exit 0: the call failed
    assert verdict.stdout == f"refused: {errno_text}\n", verdict.stdout
    assert "ESCAPED" not in verdict.stdout


def test_threads_fork_and_spawn_still_work_under_the_syscall_filter(any_verifier):
    verdict = any_verifier.verify(ORDINARY_PROCESSES)
    assert verdict.status is Status.PASSED, verdict
    assert verdict.stdout == "10100 42 7 spawned\n"


_cgroup_base, _no_cgroup_why = find_memory_cgroup()


@pytest.mark.skipif(_cgroup_base is None,
                    reason=f"the host gives the sandbox no memory cgroup ({_no_cgroup_why})")
def test_tmpfs_pages_count_against_the_runs_memory_cgroup(verifier):
    """/tmp may hold 256 MiB, but the run as a whole only 96 MiB: the cgroup stops it."""
    bounded = with_run_limits(verifier, tmp_bytes=256 << 20, file_bytes=16 << 20,
                              memory_bytes=64 << 20, cgroup_memory_bytes=96 << 20)
    with watch_host_shmem() as shmem:
        verdict = bounded.verify(FILL_TMP.replace("SIZE_MB", "200"))
    assert verdict.status is Status.MEMORY_LIMIT, verdict
    assert "OOM-killed" in verdict.detail
    assert f"cgroup v{_cgroup_base.version}: 96 MiB" in verdict.memory_bound
    assert shmem.growth_bytes < 160 << 20, shmem


def test_without_a_memory_cgroup_tmp_is_still_capped(monkeypatch):
    """The fallback: no cgroup, but /tmp's size cap stops the same program, and says so."""
    monkeypatch.setenv("MEGACPP_SANDBOX_CGROUP", "off")
    fallback = with_run_limits(make_verifier(), tmp_bytes=32 << 20)
    with watch_host_shmem() as shmem:
        verdict = fallback.verify(FILL_TMP.replace("SIZE_MB", "200"))
    assert verdict.status is Status.FAILED, verdict
    assert "No space left on device" in verdict.stderr
    assert verdict.memory_bound.startswith("rlimits only:"), verdict.memory_bound
    assert shmem.growth_bytes < 96 << 20, shmem
