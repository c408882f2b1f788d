"""Where the sandbox's memory cgroup goes: the discovery rules over cgroup trees laid out as
the kernel shows them (mountinfo, /proc/self/cgroup, the control files). A cgroup v2 memory
controller is not available on every test host, so these trees are directories; the real
cgroup on this host is exercised by tests/eval (test_eval_sandbox, test_eval_hostile)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megacpp.contract import sandbox_host
from megacpp.contract.sandbox_host import CGROUP_ENV, find_memory_cgroup


def _host(tmp_path: Path, monkeypatch, mounts: list[tuple[str, str, str, str]],
          own: list[str]) -> None:
    """mounts: (root, mount point, fstype, super options); own: /proc/self/cgroup lines."""
    lines = [f"{30 + i} 23 0:{40 + i} {root} {point} rw,relatime - {fstype} {fstype} {options}"
             for i, (root, point, fstype, options) in enumerate(mounts)]
    (tmp_path / "mountinfo").write_text("\n".join(lines) + "\n")
    (tmp_path / "cgroup").write_text("\n".join(own) + "\n")
    monkeypatch.setattr(sandbox_host, "_MOUNTINFO", tmp_path / "mountinfo")
    monkeypatch.setattr(sandbox_host, "_OWN_CGROUP", tmp_path / "cgroup")


def _v2_dir(path: Path, subtree: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "cgroup.subtree_control").write_text(subtree + "\n")
    (path / "cgroup.procs").write_text("")
    return path


def test_v2_uses_the_parent_when_the_processes_sit_in_a_leaf(tmp_path, monkeypatch):
    unified = tmp_path / "unified"
    _v2_dir(unified / "svc" / "leaf", "")
    _v2_dir(unified / "svc", "cpu memory pids")
    _host(tmp_path, monkeypatch, [("/", str(unified), "cgroup2", "rw")], ["0::/svc/leaf"])
    base, why = find_memory_cgroup({})
    assert (base.version, base.path) == (2, unified / "svc") and "v2" in why


def test_v2_without_a_delegated_memory_controller_has_none_and_says_why(tmp_path, monkeypatch):
    unified = tmp_path / "unified"
    _v2_dir(unified / "svc" / "leaf", "")
    _v2_dir(unified / "svc", "cpu pids")
    _host(tmp_path, monkeypatch, [("/", str(unified), "cgroup2", "rw")], ["0::/svc/leaf"])
    base, why = find_memory_cgroup({})
    assert base is None and "no memory controller delegated" in why


def test_hybrid_hosts_fall_back_to_the_v1_memory_hierarchy(tmp_path, monkeypatch):
    unified, memory = tmp_path / "unified", tmp_path / "memory"
    _v2_dir(unified, "hugetlb")
    (memory / "jobs" / "42").mkdir(parents=True)
    _host(tmp_path, monkeypatch,
          [("/", str(unified), "cgroup2", "rw"), ("/", str(memory), "cgroup", "rw,memory")],
          ["4:memory:/jobs/42", "0::/"])
    base, _ = find_memory_cgroup({})
    assert (base.version, base.path) == (1, memory / "jobs" / "42")


def test_a_container_mount_shows_its_own_root(tmp_path, monkeypatch):
    memory = tmp_path / "memory"
    (memory / "x").mkdir(parents=True)
    _host(tmp_path, monkeypatch, [("/docker/abc", str(memory), "cgroup", "rw,memory")],
          ["4:memory:/docker/abc/x"])
    assert find_memory_cgroup({})[0].path == memory / "x"
    _host(tmp_path, monkeypatch, [("/docker/abc", str(memory), "cgroup", "rw,memory")],
          ["4:memory:/elsewhere"])
    assert find_memory_cgroup({})[0] is None


def test_the_environment_variable_chooses_or_turns_off(tmp_path, monkeypatch):
    unified = tmp_path / "unified"
    _v2_dir(unified / "eval", "memory")
    _v2_dir(unified / "plain", "")
    _host(tmp_path, monkeypatch, [("/", str(unified), "cgroup2", "rw")], ["0::/"])
    base, why = find_memory_cgroup({CGROUP_ENV: str(unified / "eval")})
    assert base.path == unified / "eval" and CGROUP_ENV in why
    assert find_memory_cgroup({CGROUP_ENV: "off"}) == (None, f"disabled by {CGROUP_ENV}=off")
    for path, says in ((unified / "plain", "without the memory controller"),
                       (tmp_path, "not inside a cgroup"), (tmp_path / "nope", "not a directory")):
        base, why = find_memory_cgroup({CGROUP_ENV: str(path)})
        assert base is None and says in why


@pytest.mark.parametrize("mounts", [[], [("/", "/x", "cgroup", "rw,cpu")]])
def test_no_memory_hierarchy_at_all(tmp_path, monkeypatch, mounts):
    _host(tmp_path, monkeypatch, mounts, ["0::/"])
    base, why = find_memory_cgroup({})
    assert base is None and why
