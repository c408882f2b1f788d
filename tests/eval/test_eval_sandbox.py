"""The sandbox at the process level: environment, mounts, namespaces, reports, failures."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from megacpp.errors import ConfigError
from megacpp.eval import Isolation, Limits, Mount, Sandbox, SandboxError
from megacpp.eval.launcher import jail_binary
from megacpp.eval.sandbox import ISOLATION_ENV

LIMITS = Limits(cpu_s=2, wall_s=10.0)


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox("namespaces")


def sh(sandbox: Sandbox, script: str, mounts=(), cwd: str = "/", **env: str):
    return sandbox.execute(["/bin/sh", "-c", script], mounts=list(mounts), cwd=cwd,
                           limits=LIMITS, env=env)


def test_exit_codes_and_signals_are_reported(sandbox):
    assert sh(sandbox, "exit 7").exit_code == 7
    killed = sh(sandbox, "kill -SEGV $$")
    assert killed.exit_code is None and killed.signal == signal.SIGSEGV
    ran = sh(sandbox, "echo out; echo err >&2")
    assert (ran.stdout, ran.stderr) == (b"out\n", b"err\n")
    assert ran.cpu_s is not None and ran.max_rss_kb > 0


def test_the_environment_is_scrubbed(sandbox, monkeypatch):
    monkeypatch.setenv("MEGACPP_TEST_SECRET", "hunter2")
    ran = sh(sandbox, "env", EXTRA="given")
    names = {line.split("=", 1)[0] for line in ran.stdout.decode().splitlines()}
    assert "MEGACPP_TEST_SECRET" not in names
    assert {"PATH", "HOME", "TMPDIR", "EXTRA"} <= names


def test_mounts_are_read_only_unless_writable(sandbox, tmp_path):
    (tmp_path / "input.txt").write_text("hello")
    sandbox.prepare_workdir(tmp_path)
    read_only = sh(sandbox, "cat /data/input.txt && touch /data/new", [Mount(tmp_path, "/data")])
    assert read_only.stdout == b"hello" and read_only.exit_code != 0
    assert b"Read-only file system" in read_only.stderr
    writable = sh(sandbox, "echo made > /data/new", [Mount(tmp_path, "/data", writable=True)])
    assert writable.exit_code == 0 and (tmp_path / "new").read_text() == "made\n"


def test_each_run_has_its_own_tmp_proc_and_hostname(sandbox):
    sh(sandbox, "echo left > /tmp/leftover")
    assert sh(sandbox, "cat /tmp/leftover").exit_code != 0
    processes = sh(sandbox, "ls /proc | grep -c '^[0-9]'").stdout.decode().strip()
    assert int(processes) <= 4  # init, sh, ls, grep: no host process is visible
    assert sh(sandbox, "hostname").stdout.strip() == b"megacpp-sandbox"
    listing = sh(sandbox, "ls /").stdout.decode().split()
    assert "root" not in listing and "home" not in listing and "work" not in listing


def test_the_rlimits_fallback_runs_in_the_given_directory(tmp_path):
    fallback = Sandbox("rlimits")
    work = Mount(tmp_path, "/sandbox", writable=True)
    fallback.prepare_workdir(tmp_path)
    ran = sh(fallback, "pwd; echo x > here", cwd=fallback.jail_path(work))
    assert ran.stdout.decode().strip() == str(tmp_path)
    assert (tmp_path / "here").exists()


def test_a_missing_bind_source_fails_closed(sandbox, tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(SandboxError, match=str(missing)):
        sh(sandbox, "true", [Mount(missing, "/data")])


def test_a_missing_program_fails_closed(sandbox):
    with pytest.raises(SandboxError, match="/no/such/program"):
        sandbox.execute(["/no/such/program"], mounts=[], cwd="/", limits=LIMITS)


def test_isolation_is_chosen_by_name_or_environment(monkeypatch):
    monkeypatch.setenv(ISOLATION_ENV, "rlimits")
    assert Sandbox().isolation is Isolation.RLIMITS
    monkeypatch.delenv(ISOLATION_ENV)
    assert Sandbox().isolation is Isolation.NAMESPACES
    with pytest.raises(ConfigError, match="namespaces, rlimits"):
        Sandbox("chroot")


@pytest.mark.parametrize("changes", [{"cpu_s": 0}, {"wall_s": -1.0}, {"memory_bytes": 0},
                                     {"nice": 40}, {"output_bytes": 0}])
def test_bad_limits_are_refused(changes):
    with pytest.raises(ConfigError, match=next(iter(changes))):
        Limits().replace(**changes)


def test_the_launcher_is_built_into_the_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGACPP_CACHE_DIR", str(tmp_path))
    built = jail_binary()
    assert built.parent == tmp_path / "sandbox" and os.access(built, os.X_OK)
    assert jail_binary() == built  # cached by source hash
    monkeypatch.setenv("MEGACPP_CACHE_DIR", str(tmp_path / "other"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(SandboxError, match="no compiler .cc or gcc. on PATH"):
        jail_binary()


def test_describe_names_every_active_mechanism(sandbox):
    mechanisms = dict(sandbox.describe())
    for name in ("network namespace", "mount namespace", "pid namespace", "rlimits"):
        assert name in mechanisms
    weak = dict(Sandbox("rlimits").describe())
    assert weak["network"].startswith("NOT")


def test_sandbox_paths_under_each_isolation(tmp_path):
    mount = Mount(tmp_path, "/sandbox")
    assert Sandbox("namespaces").jail_path(mount) == "/sandbox"
    assert Sandbox("rlimits").jail_path(mount) == str(tmp_path)
    assert Sandbox("namespaces").scratch_dir(mount) == "/tmp"
    assert Path(Sandbox("rlimits").scratch_dir(mount)) == tmp_path
