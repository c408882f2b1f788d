"""What this host lets the C++ verifier sandbox guarantee (read-only probes).

The sandbox (``megacpp.eval``) leans on three host features:

* **seccomp filters** -- the jail denies namespace and mount system calls to the programs
  it runs, so a program cannot build itself a fresh tmpfs outside every limit;
* **user namespaces** -- ``user.max_user_namespaces > 0``, needed to build the jail;
* **a memory cgroup the sandbox may create children in** -- one memory bound per run that
  counts every process, page cache and tmpfs. Found in this order: ``$MEGACPP_SANDBOX_CGROUP``
  (a directory, or ``off``), else the process's own cgroup (cgroup v2: when it has the
  ``memory`` controller enabled for its children; v1: the memory hierarchy), else its
  parent (cgroup v2 only, e.g. a delegated service whose processes sit in a leaf).

These probes never create anything; ``megacpp.eval.cgroup`` makes the real per-run cgroups.
:func:`sandbox_host` is the ``sandbox`` section of the environment fingerprint, read by the
preflight rule ``sandbox-host``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CGROUP_ENV = "MEGACPP_SANDBOX_CGROUP"
CGROUP_OFF = "off"
SECCOMP_ACTIONS = Path("/proc/sys/kernel/seccomp/actions_avail")
MAX_USER_NAMESPACES = Path("/proc/sys/user/max_user_namespaces")
_MOUNTINFO = Path("/proc/self/mountinfo")
_OWN_CGROUP = Path("/proc/self/cgroup")


@dataclass(frozen=True)
class MemoryCgroupBase:
    """A cgroup directory the sandbox may create one child per run in."""

    version: int  # 1 (the v1 memory hierarchy) or 2 (the unified hierarchy)
    path: Path

    def describe(self) -> str:
        return f"cgroup v{self.version} {self.path}"


def seccomp_available() -> bool:
    """The kernel takes seccomp BPF filters that can return an errno and kill a process."""
    try:
        actions = SECCOMP_ACTIONS.read_text().split()
    except OSError:
        return False
    return "errno" in actions and "kill_process" in actions


def max_user_namespaces() -> int | None:
    """``user.max_user_namespaces`` as this process sees it (None when unreadable)."""
    try:
        return int(MAX_USER_NAMESPACES.read_text())
    except (OSError, ValueError):
        return None


def find_memory_cgroup(env: Mapping[str, str] | None = None) -> tuple[MemoryCgroupBase | None, str]:
    """The cgroup the sandbox would create run cgroups in, and a one-line reason.

    Returns ``(base, how it was chosen)`` or ``(None, why there is none)``.
    """
    env = os.environ if env is None else env
    mounts = _cgroup_mounts()
    explicit = env.get(CGROUP_ENV, "").strip()
    if explicit == CGROUP_OFF:
        return None, f"disabled by {CGROUP_ENV}={CGROUP_OFF}"
    if explicit:
        return _explicit_base(Path(explicit), mounts)
    own = _own_cgroups()
    unified = mounts.get("cgroup2")
    if unified is not None and "" in own:
        found = _v2_base(_locate(unified, own[""]))
        if found is not None:
            return found, "the cgroup v2 memory controller is delegated here"
    legacy = mounts.get("memory")
    if legacy is not None and "memory" in own:
        path = _locate(legacy, own["memory"])
        if path is not None and _writable(path):
            return MemoryCgroupBase(1, path), "the cgroup v1 memory hierarchy is writable here"
    return None, _why_none(mounts, own)


def sandbox_host(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The fingerprint's ``sandbox`` section: what the verifier sandbox can rely on here."""
    base, why = find_memory_cgroup(env)
    return {
        "seccomp": seccomp_available(),
        "user_namespaces": max_user_namespaces(),
        "memory_cgroup": base.describe() if base else None,
        "memory_cgroup_note": why,
    }


# --- cgroup discovery -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Mount:
    root: str  # the cgroup path mounted here, as this process's cgroup namespace names it
    point: Path


def _cgroup_mounts() -> dict[str, _Mount]:
    """{"cgroup2": unified mount, "memory": v1 memory mount}, those that are mounted."""
    found: dict[str, _Mount] = {}
    try:
        lines = _MOUNTINFO.read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        fstype = fields[sep + 1]
        options = fields[sep + 3].split(",") if len(fields) > sep + 3 else []
        mount = _Mount(_unescape(fields[3]), Path(_unescape(fields[4])))
        if fstype == "cgroup2":
            found.setdefault("cgroup2", mount)
        elif fstype == "cgroup" and "memory" in options:
            found.setdefault("memory", mount)
    return found


def _own_cgroups() -> dict[str, str]:
    """{controller list: path} from /proc/self/cgroup; "" is the unified (v2) hierarchy."""
    own: dict[str, str] = {}
    try:
        lines = _OWN_CGROUP.read_text().splitlines()
    except OSError:
        return own
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for controller in controllers.split(",") if controllers else [""]:
            own[controller] = path
    return own


def _locate(mount: _Mount, cgroup: str) -> Path | None:
    """The directory of ``cgroup`` under ``mount`` (None if the mount does not show it)."""
    root = mount.root.rstrip("/")
    if cgroup != root and not cgroup.startswith(root + "/"):
        return None
    return mount.point / cgroup[len(root):].lstrip("/")


def _v2_base(own: Path | None) -> MemoryCgroupBase | None:
    """Our own v2 cgroup, else its parent, if the memory controller is on for its children and
    we may create a child and move a process into it (write access to the common ancestor's
    cgroup.procs, the delegation rule)."""
    if own is None:
        return None
    for candidate in (own, own.parent):
        if _v2_delegated(candidate):
            return MemoryCgroupBase(2, candidate)
    return None


def _v2_delegated(path: Path) -> bool:
    try:
        enabled = (path / "cgroup.subtree_control").read_text().split()
    except OSError:
        return False
    return "memory" in enabled and _writable(path) and os.access(path / "cgroup.procs", os.W_OK)


def _explicit_base(path: Path, mounts: dict[str, _Mount]) -> tuple[MemoryCgroupBase | None, str]:
    chosen = f"{CGROUP_ENV}={path}"
    if not path.is_dir():
        return None, f"{chosen} is not a directory"
    resolved = path.resolve()
    for kind, mount in mounts.items():
        if resolved == mount.point or mount.point in resolved.parents:
            if kind == "cgroup2":
                if not _v2_delegated(resolved):
                    return None, (f"{chosen} is a cgroup v2 directory without the memory "
                                  f"controller in its cgroup.subtree_control, or not writable")
                return MemoryCgroupBase(2, resolved), f"chosen by {chosen}"
            if not _writable(resolved):
                return None, f"{chosen} is not writable"
            return MemoryCgroupBase(1, resolved), f"chosen by {chosen}"
    return None, f"{chosen} is not inside a cgroup v2 or cgroup v1 memory mount"


def _why_none(mounts: dict[str, _Mount], own: dict[str, str]) -> str:
    if not mounts:
        return "no cgroup v2 or cgroup v1 memory hierarchy is mounted"
    reasons = []
    if "cgroup2" in mounts:
        reasons.append("cgroup v2: no memory controller delegated to this cgroup or its parent")
    if "memory" in mounts:
        reasons.append("cgroup v1 memory: this cgroup is not writable")
    return "; ".join(reasons) if reasons else "no cgroup memory controller is reachable"


def _writable(path: Path) -> bool:
    return os.access(path, os.W_OK | os.X_OK)


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (\\040 ...)."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field
