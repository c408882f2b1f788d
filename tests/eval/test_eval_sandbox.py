"""The sandbox at the process level: environment, mounts, namespaces, reports, failures."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from megacpp.contract.sandbox_host import CGROUP_ENV, find_memory_cgroup
from megacpp.errors import ConfigError
from megacpp.eval import Isolation, Limits, Mount, Sandbox, SandboxError
from megacpp.eval import sandbox as sandbox_module
from megacpp.eval.cgroup import RUN_PREFIX, RunCgroup
from megacpp.eval.launcher import jail_binary
from megacpp.eval.sandbox import ISOLATION_ENV, _Capture, _execution
from megacpp.eval.verdict import Status, run_verdict
from tests.eval.conftest import sandbox_processes

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
    for name in ("network namespace", "mount namespace", "pid namespace", "rlimits", "seccomp",
                 "memory bound"):
        assert name in mechanisms
    weak = dict(Sandbox("rlimits").describe())
    assert weak["network"].startswith("NOT")


def test_sandbox_paths_under_each_isolation(tmp_path):
    mount = Mount(tmp_path, "/sandbox")
    assert Sandbox("namespaces").jail_path(mount) == "/sandbox"
    assert Sandbox("rlimits").jail_path(mount) == str(tmp_path)
    assert Sandbox("namespaces").scratch_dir(mount) == "/tmp"
    assert Path(Sandbox("rlimits").scratch_dir(mount)) == tmp_path


def test_the_program_runs_under_the_filter_with_no_namespaces_to_spare(sandbox):
    ran = sh(sandbox, "grep Seccomp: /proc/self/status; cat /proc/sys/user/max_user_namespaces "
                      "/proc/sys/user/max_mnt_namespaces /proc/self/oom_score_adj")
    assert ran.stdout.decode().split() == ["Seccomp:", "2", "0", "0", "1000"], ran
    fallback = sh(Sandbox("rlimits"), "grep Seccomp: /proc/self/status")
    assert fallback.stdout.decode().split() == ["Seccomp:", "2"]


def test_an_explicit_cgroup_setting_fails_closed_and_off_warns_once(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(CGROUP_ENV, str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="is not a directory"):
        Sandbox()
    monkeypatch.setenv(CGROUP_ENV, str(tmp_path))
    with pytest.raises(ConfigError, match="not inside a cgroup"):
        Sandbox()
    monkeypatch.setenv(CGROUP_ENV, "off")
    monkeypatch.setattr(sandbox_module, "_warned", set())
    capsys.readouterr()
    first, second = Sandbox(), Sandbox("rlimits")
    assert first.cgroups is None and second.cgroups is None
    warnings = [line for line in capsys.readouterr().err.splitlines() if "memory cgroup" in line]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("warning: no memory cgroup") and "=off" in warnings[0]
    assert first.memory_bound(Limits()).startswith("rlimits only: 1024 MiB address space")
    assert first.guarantees()["memory_cgroup"] is None


def test_a_run_killed_with_its_jail_by_the_oom_killer_is_a_memory_limit():
    """When the OOM killer also ends the jail (memory kept in a tmpfs outlives the program),
    no exit report comes back: the cgroup's record alone decides the verdict."""
    capture = _Capture(bytearray(), bytearray(), oom_killed=True, memory_bound="cgroup v2: 1 MiB")
    execution = _execution("", capture, 0.5, -9, "main")
    assert execution.oom_killed and execution.exit_code is None
    verdict = run_verdict(execution, Limits(), compile_s=0.1)
    assert verdict.status is Status.MEMORY_LIMIT and "cgroup v2: 1 MiB" in verdict.detail
    with pytest.raises(SandboxError, match="without reporting"):
        _execution("", _Capture(bytearray(), bytearray()), 0.5, -9, "main")


_base, _why = find_memory_cgroup()
needs_cgroup = pytest.mark.skipif(_base is None, reason=f"no memory cgroup here: {_why}")


@needs_cgroup
def test_each_run_gets_its_own_limited_cgroup_and_leaves_none_behind(sandbox):
    ran = sh(sandbox, "cat /proc/self/cgroup")
    own = [line for line in ran.stdout.decode().splitlines()
           if RUN_PREFIX in line and (line.startswith("0::") or ":memory:" in line)]
    assert len(own) == 1, ran.stdout
    # Without namespaces the host's cgroup files are visible: read the run's own limit.
    limit_file = "memory.max" if _base.version == 2 else "memory.limit_in_bytes"
    script = (f"name=$(grep -E '^0::|:memory:' /proc/self/cgroup | grep {RUN_PREFIX} | "
              f"sed 's|.*/||'); cat {_base.path}/$name/{limit_file}")
    limited = Sandbox("rlimits").execute(["/bin/sh", "-c", script], mounts=[], cwd="/",
                                         limits=LIMITS.replace(cgroup_memory_bytes=80 << 20))
    assert limited.stdout == b"83886080\n" and "80 MiB" in limited.memory_bound, limited
    run_dir = _base.path / own[0].rsplit("/", 1)[1]
    assert not run_dir.exists() and not list(_base.path.glob(f"{RUN_PREFIX}{os.getpid()}-*"))


@needs_cgroup
@pytest.mark.skipif(os.geteuid() != 0, reason="counts the sandbox uid's processes on the host")
def test_the_cgroup_kills_what_escaped_the_process_group():
    """Without namespaces, setsid takes a daemon out of the process group the harness kills;
    it is still in the run's cgroup, which is emptied when the run ends."""
    before = set(sandbox_processes())
    ran = sh(Sandbox("rlimits"), "setsid sleep 300 > /dev/null 2>&1 < /dev/null & echo started")
    assert ran.stdout == b"started\n"
    assert set(sandbox_processes()) - before == set()


def test_oom_kills_are_read_from_either_cgroup_version(tmp_path):
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 3\noom_kill 2\n")
    (tmp_path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    assert RunCgroup(2, tmp_path, 1 << 20).oom_kills() == 2
    assert RunCgroup(1, tmp_path, 1 << 20).oom_kills() == 1
    assert RunCgroup(2, tmp_path / "gone", 1 << 20).oom_kills() == 0
