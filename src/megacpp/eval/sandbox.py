"""Run one untrusted command in isolation and return its raw outcome.

Every process goes through ``megacpp-jail`` (see ``jail.c``). Two isolation levels:

``namespaces`` (default, required unless the weaker level is chosen explicitly)
    fresh mount, network, pid, ipc and uts namespaces; a private root holding only the
    system directories (read-only), ``/dev`` basics, its own ``/proc``, a size-limited
    private ``/tmp`` and the run's bind mounts; the program runs as an unprivileged uid
    (``nobody`` when started as root, the caller's own uid otherwise) inside a user
    namespace of its own, so ``RLIMIT_NPROC`` counts only this run. Killing the jail's
    init kills every process of the run.
``rlimits`` (fallback, opt-in via ``MEGACPP_SANDBOX_ISOLATION=rlimits``)
    no namespaces: rlimits, niceness, a scrubbed environment, its own process group and,
    when started as root, the ``nobody`` uid. No network or filesystem isolation.

Both levels: CPU time, address space, file size, process and open-file limits; a wall-clock
deadline that SIGKILLs the whole process group; stdout+stderr captured up to a byte limit; a
seccomp filter that denies namespace and mount calls (where the kernel takes filters); and,
where the host lets us create one, a memory cgroup per run that bounds everything the run
holds, page cache and tmpfs included (:mod:`megacpp.eval.cgroup`). Which memory bound was in
force is part of every :class:`Execution` (and so of every verdict and receipt); a host that
cannot provide the cgroup or the filter gets a one-line warning.
Classification into verdicts lives in :mod:`megacpp.eval.verdict`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from megacpp.contract.sandbox_host import (
    CGROUP_ENV,
    CGROUP_OFF,
    find_memory_cgroup,
    seccomp_available,
)
from megacpp.errors import ConfigError
from megacpp.eval.cgroup import MemoryCgroups, RunCgroup
from megacpp.eval.launcher import SandboxError, jail_binary

ISOLATION_ENV = "MEGACPP_SANDBOX_ISOLATION"
SANDBOX_UID = 65534  # nobody: the identity a root-started sandbox drops to
SANDBOX_GID = 65534
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
_READ_CHUNK = 1 << 16


class Isolation(str, Enum):
    NAMESPACES = "namespaces"
    RLIMITS = "rlimits"


@dataclass(frozen=True)
class Limits:
    """Resource limits for one sandboxed process tree."""

    cpu_s: int = 5  # RLIMIT_CPU per process: SIGXCPU, then SIGKILL one second later
    wall_s: float = 10.0  # wall clock for the whole tree, then SIGKILL to all of it
    memory_bytes: int | None = 1 << 30  # RLIMIT_AS; None = unlimited (sanitizer builds)
    file_bytes: int = 16 << 20  # RLIMIT_FSIZE: the largest file it may write
    tmp_bytes: int = 64 << 20  # size of its private /tmp (namespaces isolation)
    output_bytes: int = 1 << 20  # stdout + stderr kept; more ends the run (output_limit)
    processes: int = 32  # RLIMIT_NPROC (counted per run under namespaces isolation)
    open_files: int = 64  # RLIMIT_NOFILE
    nice: int = 10  # scheduling niceness, so a runaway program cannot starve the host
    # The whole run (every process, page cache, tmpfs) where a memory cgroup is available;
    # None = memory_bytes + tmp_bytes (no cgroup limit when memory_bytes is None too).
    cgroup_memory_bytes: int | None = None

    def __post_init__(self) -> None:
        positive = ("cpu_s", "wall_s", "file_bytes", "tmp_bytes", "output_bytes",
                    "processes", "open_files")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"sandbox limit {name} must be > 0, got {getattr(self, name)}")
        for name in ("memory_bytes", "cgroup_memory_bytes"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"sandbox limit {name} must be > 0 or None, got {value}")
        if not 0 <= self.nice <= 19:
            raise ConfigError(f"sandbox limit nice must be in 0..19, got {self.nice}")

    def replace(self, **changes: object) -> Limits:
        return dataclasses.replace(self, **changes)

    def run_memory_bytes(self) -> int | None:
        """The memory cgroup limit for one run (None: no limit)."""
        if self.cgroup_memory_bytes is not None:
            return self.cgroup_memory_bytes
        return None if self.memory_bytes is None else self.memory_bytes + self.tmp_bytes


@dataclass(frozen=True)
class Mount:
    """A host path made visible inside the jail at ``jail`` (read-only unless ``writable``)."""

    host: Path
    jail: str
    writable: bool = False


@dataclass(frozen=True)
class Execution:
    """How one sandboxed command ended, before any interpretation."""

    exit_code: int | None  # None when killed by a signal or by the harness
    signal: int | None  # the signal that ended the program, if any
    stdout: bytes
    stderr: bytes
    wall_s: float
    cpu_s: float | None  # user + system time of the program (None if it was killed)
    max_rss_kb: int | None
    timed_out: bool  # the harness killed it at the wall-clock deadline
    output_exceeded: bool  # the harness killed it for writing more than output_bytes
    oom_killed: bool = False  # the run's memory cgroup OOM-killed a process of the run
    memory_bound: str = ""  # the memory guarantee that was in force (Sandbox.memory_bound)


class Sandbox:
    """Runs commands under one isolation level; cheap to share between threads."""

    def __init__(self, isolation: Isolation | str | None = None) -> None:
        self.isolation = resolve_isolation(isolation)
        self._jail = jail_binary()
        host = _host_guarantees(os.environ.get(CGROUP_ENV, "").strip())
        self.seccomp = host.seccomp
        self.cgroups = host.cgroups
        self.cgroup_note = host.cgroup_note
        for warning in host.warnings:
            _warn_once(warning)

    def probe(self) -> None:
        """Run ``true`` in the jail; raise :class:`SandboxError` if this level cannot work here."""
        true = shutil.which("true") or "/bin/true"
        result = self.execute([true], mounts=[], cwd="/", limits=Limits(wall_s=30))
        if result.exit_code != 0:
            raise SandboxError(f"the sandbox probe {true} ended with {result}")

    @property
    def namespaces(self) -> bool:
        return self.isolation is Isolation.NAMESPACES

    def jail_path(self, mount: Mount) -> str:
        """Where ``mount`` appears to the sandboxed program."""
        return mount.jail if self.namespaces else str(mount.host)

    def scratch_dir(self, work: Mount) -> str:
        """A writable working directory private to one run."""
        return "/tmp" if self.namespaces else str(work.host)

    def memory_bound(self, limits: Limits) -> str:
        """One line: what bounds a run's memory under ``limits`` on this host."""
        whole_run = limits.run_memory_bytes()
        if self.cgroups is not None and whole_run is not None:
            return (f"cgroup v{self.cgroups.version}: {_mib(whole_run)} for the whole run "
                    f"(every process, page cache, tmpfs)")
        per_process = ("address space unlimited" if limits.memory_bytes is None
                       else f"{_mib(limits.memory_bytes)} address space per process")
        tmp = f"/tmp {_mib(limits.tmp_bytes)}" if self.namespaces else "host /tmp (not private)"
        return f"rlimits only: {per_process}, {tmp}, files {_mib(limits.file_bytes)}"

    def guarantees(self) -> dict[str, object]:
        """What this sandbox relies on here (for receipts)."""
        return {
            "isolation": self.isolation.value,
            "seccomp": self.seccomp,
            "memory_cgroup": self.cgroups.base.describe() if self.cgroups else None,
            "memory_cgroup_note": self.cgroup_note,
        }

    def prepare_workdir(self, path: Path) -> None:
        """Let the sandbox identity write into ``path`` (a root-started sandbox runs as nobody)."""
        if os.geteuid() == 0:
            os.chown(path, SANDBOX_UID, SANDBOX_GID)

    def execute(
        self,
        argv: Sequence[str],
        *,
        mounts: Sequence[Mount],
        cwd: str,
        limits: Limits,
        env: Mapping[str, str] | None = None,
    ) -> Execution:
        """Run ``argv`` (paths as the jail sees them) and wait for it within ``limits``."""
        whole_run = limits.run_memory_bytes()
        run_cgroup = (self.cgroups.create(whole_run)
                      if self.cgroups is not None and whole_run is not None else None)
        try:
            return self._execute(argv, mounts, cwd, limits, env or {}, run_cgroup)
        finally:
            if run_cgroup is not None:
                run_cgroup.remove()

    def _execute(self, argv: Sequence[str], mounts: Sequence[Mount], cwd: str, limits: Limits,
                 env: Mapping[str, str], run_cgroup: RunCgroup | None) -> Execution:
        read_fd, write_fd = os.pipe()
        command = self._command(argv, mounts, cwd, limits, env, write_fd, run_cgroup)
        started = time.monotonic()
        try:
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(write_fd,),
                start_new_session=True,
            )
        except OSError as exc:
            os.close(read_fd)
            raise SandboxError(f"cannot start the sandbox launcher {self._jail}: {exc}") from None
        finally:
            os.close(write_fd)
        try:
            capture = _capture(process, started + limits.wall_s, limits.output_bytes)
        finally:
            _kill_group(process)
            process.wait()
            with os.fdopen(read_fd, "rb") as status:
                report = status.read().decode("utf-8", "replace")
        wall_s = time.monotonic() - started
        capture.oom_killed = run_cgroup is not None and run_cgroup.oom_kills() > 0
        capture.memory_bound = self.memory_bound(limits)
        try:
            return _execution(report, capture, wall_s, process.returncode, argv[0])
        except SandboxError as exc:
            if self.namespaces and any(step in str(exc) for step in _NAMESPACE_STEPS):
                raise SandboxError(f"{exc}. Hint: {_NAMESPACE_HINT}") from None
            raise

    def _command(
        self,
        argv: Sequence[str],
        mounts: Sequence[Mount],
        cwd: str,
        limits: Limits,
        env: Mapping[str, str],
        status_fd: int,
        run_cgroup: RunCgroup | None = None,
    ) -> list[str]:
        command = [str(self._jail), "--isolation", self.isolation.value,
                   "--status-fd", str(status_fd), "--cwd", cwd,
                   "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_GID)]
        command += _limit_args(limits)
        if run_cgroup is not None:
            command += ["--cgroup", str(run_cgroup.path)]
        if not self.seccomp:
            command.append("--no-seccomp")
        if self.namespaces:
            for mount in mounts:
                if ":" in str(mount.host) or not mount.jail.startswith("/"):
                    raise ConfigError(f"cannot mount {mount.host} at {mount.jail}: the host path "
                                      f"may not contain ':' and the jail path must be absolute")
                flag = "--rw-bind" if mount.writable else "--bind"
                command += [flag, f"{mount.host}:{mount.jail}"]
        for key, value in self._environment(cwd, env).items():
            command += ["--env", f"{key}={value}"]
        return [*command, "--", *argv]

    def _environment(self, cwd: str, extra: Mapping[str, str]) -> dict[str, str]:
        """The program's whole environment: nothing leaks in from the harness."""
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": cwd,
            "TMPDIR": "/tmp" if self.namespaces else cwd,
            "LC_ALL": "C",
            "LANG": "C",
        }
        env.update(extra)
        return env

    def describe(self) -> list[tuple[str, str]]:
        """(mechanism, what it does here) for the active isolation level."""
        return describe_mechanisms(self.isolation, os.geteuid(), seccomp=self.seccomp,
                                   memory_cgroup=self.cgroups.base.describe() if self.cgroups
                                   else None, cgroup_note=self.cgroup_note)


@dataclass(frozen=True)
class _Host:
    """What this host provides the sandbox, resolved once per process (per cgroup setting)."""

    seccomp: bool
    cgroups: MemoryCgroups | None
    cgroup_note: str
    warnings: tuple[str, ...]


@functools.cache
def _host_guarantees(cgroup_setting: str) -> _Host:
    """Seccomp support and the memory cgroup base; an explicit ``$MEGACPP_SANDBOX_CGROUP``
    that cannot be used fails closed, the automatic choice degrades with a warning."""
    warnings = []
    seccomp = seccomp_available()
    if not seccomp:
        warnings.append("the kernel takes no seccomp filters: sandboxed programs may create "
                        "namespaces and mount file systems (docs/eval.md, threat model)")
    base, note = find_memory_cgroup({CGROUP_ENV: cgroup_setting})
    cgroups = None
    if base is not None:
        cgroups = MemoryCgroups(base)
        try:
            cgroups.probe()
        except SandboxError as exc:
            if cgroup_setting:
                raise ConfigError(f"{CGROUP_ENV}={cgroup_setting} cannot be used: {exc}") from None
            cgroups, note = None, str(exc)
    elif cgroup_setting and cgroup_setting != CGROUP_OFF:
        raise ConfigError(f"{note}; set {CGROUP_ENV} to a cgroup directory the sandbox may "
                          f"create children in, or to {CGROUP_OFF}")
    if cgroups is None:
        warnings.append(f"no memory cgroup for sandboxed runs ({note}): memory is bounded per "
                        f"process and /tmp by its size cap, not per run (docs/eval.md)")
    return _Host(seccomp, cgroups, note, tuple(warnings))


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """One stderr line per missing guarantee and process (every eval command builds a Sandbox)."""
    if message not in _warned:
        _warned.add(message)
        print(f"warning: {message}", file=sys.stderr, flush=True)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):g} MiB"


def resolve_isolation(requested: Isolation | str | None) -> Isolation:
    """The requested level, else ``$MEGACPP_SANDBOX_ISOLATION``, else ``namespaces``.

    There is no silent downgrade: if namespaces do not work here, running anything fails
    with :class:`SandboxError` and a hint; the weaker level must be asked for by name.
    """
    value = requested if requested is not None else os.environ.get(ISOLATION_ENV, "namespaces")
    try:
        return Isolation(value)
    except ValueError:
        allowed = ", ".join(level.value for level in Isolation)
        raise ConfigError(f"sandbox isolation {value!r} is unknown; use one of: {allowed}") from None


# Words in the launcher's error for a failed namespace step (see jail.c).
_NAMESPACE_STEPS = ("unshare", "uid_map", "gid_map", "setgroups", "mount", "pivot_root")
_NAMESPACE_HINT = (
    "namespace isolation needs unprivileged user namespaces (sysctl "
    "user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1, a container profile "
    "that allows unshare) or root; to accept the weaker sandbox without network or filesystem "
    f"isolation set {ISOLATION_ENV}=rlimits"
)


def describe_mechanisms(isolation: Isolation, euid: int, *, seccomp: bool = True,
                        memory_cgroup: str | None = None,
                        cgroup_note: str = "") -> list[tuple[str, str]]:
    """The layered defences for ``isolation`` when the harness runs as ``euid``."""
    identity = (f"uid {SANDBOX_UID} (nobody); the harness runs as root" if euid == 0
                else f"the caller's uid {euid}, no capabilities")
    common = [
        ("rlimits", "CPU time, address space, file size, processes, open files; no core dumps"),
        ("wall clock", "SIGKILL to the whole process group at the deadline"),
        ("output", "stdout + stderr captured up to a byte limit, then killed"),
        ("environment", "scrubbed: PATH, HOME, TMPDIR, LC_ALL, LANG (+ sanitizer options)"),
        ("niceness", "programs run niced so the host stays responsive"),
        ("no_new_privs", "set-uid binaries cannot raise privileges"),
        ("seccomp", "namespace, mount, memfd and SysV shared-memory calls denied" if seccomp
         else "NOT available: the kernel takes no seccomp filters"),
        ("memory bound", f"{memory_cgroup}: one limit per run, page cache and tmpfs included"
         if memory_cgroup else f"per process only (RLIMIT_AS, /tmp size, file size): "
                               f"{cgroup_note}"),
    ]
    if isolation is Isolation.RLIMITS:
        return [
            ("identity", identity), *common,
            ("network", "NOT isolated"),
            ("filesystem", ("NOT isolated: host paths visible with the program uid's permissions "
                            "(it can write world-writable dirs such as /tmp); mounts not applied")),
            ("process cleanup", "process group only; a program calling setsid escapes"),
        ]
    user_ns = ("program: a fresh user namespace per run (RLIMIT_NPROC per run)" if euid == 0
               else ("caller mapped to root in a user namespace to build the jail, "
                     "program in a nested one"))
    return [
        ("identity", identity),
        ("user namespace", user_ns + "; it may create no namespaces of its own"),
        ("network namespace", "no interfaces up: loopback and outside addresses unreachable"),
        ("mount namespace", ("private root: /usr /bin /lib* /etc read-only, own /proc, "
                             "size-limited private /tmp, the run's directory")),
        ("pid namespace", "the jail's init is pid 1; its exit kills every leftover process"),
        ("ipc + uts namespaces", "no shared SysV IPC; hostname megacpp-sandbox"),
        *common,
    ]


def _limit_args(limits: Limits) -> list[str]:
    args = ["--cpu", str(limits.cpu_s), "--fsize", str(limits.file_bytes),
            "--nproc", str(limits.processes), "--nofile", str(limits.open_files),
            "--tmp-bytes", str(limits.tmp_bytes), "--nice", str(limits.nice)]
    if limits.memory_bytes is not None:
        args += ["--as", str(limits.memory_bytes)]
    return args


@dataclass
class _Capture:
    stdout: bytearray
    stderr: bytearray
    timed_out: bool = False
    output_exceeded: bool = False
    oom_killed: bool = False
    memory_bound: str = ""


def _capture(process: subprocess.Popen, deadline: float, output_bytes: int) -> _Capture:
    """Read stdout/stderr until both close, the deadline passes, or the output limit is hit."""
    capture = _Capture(bytearray(), bytearray())
    buffers = {process.stdout: capture.stdout, process.stderr: capture.stderr}
    total = 0
    with selectors.DefaultSelector() as selector:
        for stream in buffers:
            selector.register(stream, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                capture.timed_out = True
                return capture
            for key, _ in selector.select(timeout=remaining):
                data = os.read(key.fd, _READ_CHUNK)
                if not data:
                    selector.unregister(key.fileobj)
                    continue
                buffers[key.fileobj] += data[: max(0, output_bytes - total)]
                total += len(data)
                if total > output_bytes:
                    capture.output_exceeded = True
                    return capture
    try:
        process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        capture.timed_out = True
    return capture


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the launcher's process group (the jail's init with it, so the whole run)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for stream in (process.stdout, process.stderr):
        if stream is not None:
            stream.close()


def _execution(report: str, capture: _Capture, wall_s: float, launcher_code: int | None,
               program: str) -> Execution:
    lines = report.splitlines()
    errors = [line.removeprefix("error ") for line in lines if line.startswith("error ")]
    if errors:
        raise SandboxError(f"the sandbox could not run {program}: {errors[0]}")
    exits = [line.split() for line in lines if line.startswith("exit ")]
    # The OOM killer may have ended the jail itself (memory held in a tmpfs outlives the
    # program it killed first): then only the cgroup tells what happened.
    killed = capture.timed_out or capture.output_exceeded or capture.oom_killed
    if not exits:
        if not killed:
            raise SandboxError(
                f"the sandbox launcher ended (status {launcher_code}) without reporting on "
                f"{program}; stderr: {bytes(capture.stderr[:500]).decode('utf-8', 'replace')}"
            )
        return Execution(None, signal.SIGKILL, bytes(capture.stdout), bytes(capture.stderr),
                         wall_s, None, None, capture.timed_out, capture.output_exceeded,
                         capture.oom_killed, capture.memory_bound)
    wait_status, max_rss_kb, user_us, sys_us = (int(field) for field in exits[0][1:5])
    exited = os.WIFEXITED(wait_status)
    return Execution(
        exit_code=os.WEXITSTATUS(wait_status) if exited else None,
        signal=None if exited else os.WTERMSIG(wait_status),
        stdout=bytes(capture.stdout),
        stderr=bytes(capture.stderr),
        wall_s=wall_s,
        cpu_s=(user_us + sys_us) / 1e6,
        max_rss_kb=max_rss_kb,
        timed_out=capture.timed_out,
        output_exceeded=capture.output_exceeded,
        oom_killed=capture.oom_killed,
        memory_bound=capture.memory_bound,
    )
