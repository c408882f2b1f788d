"""Capture on this CPU machine: real probes, null where there is nothing to find."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from megacpp.contract import capture_fingerprint, load_fingerprint
from megacpp.contract.fingerprint import contract_packages, kernel_env, package_versions
from megacpp.contract.gitinfo import capture_git
from megacpp.contract.probes import toolchain
from megacpp.contract.versions import short_version, version_at_least, version_tuple
from megacpp.errors import MegaCppError


def test_versions_parse_and_compare():
    assert version_tuple("2.13.0+cu130") == (2, 13, 0)
    assert version_tuple("V13.0.88", 2) == (13, 0)
    assert version_tuple("cpu") is None and version_tuple(None) is None
    assert version_at_least("12.10", "12.9") and not version_at_least("12.8.93", "12.9")
    assert version_at_least("13", "12.9.1") and version_at_least(None, "1") is None
    assert short_version("12.8.93", 2) == "12.8"


def test_cpu_capture_has_real_fields_and_nulls_for_gpu(cpu_fingerprint):
    fp = cpu_fingerprint
    if fp["devices"]:
        pytest.skip("this machine has a GPU (test_contract_gpu.py covers it)")
    assert fp["schema"] == "megacpp.fingerprint" and fp["schema_version"] == 1
    assert fp["accelerator"] == "cpu" and fp["devices"] == [] and fp["driver"] is None
    assert fp["packages"]["torch"].startswith("2.")
    assert fp["packages"]["mamba-ssm"] is None  # a contract package that is not installed
    assert fp["python"]["version"].count(".") == 2
    assert fp["host"]["cpu_count"] >= 1 and fp["host"]["memory_bytes"] > 0
    sandbox = fp["sandbox"]
    assert isinstance(sandbox["seccomp"], bool) and sandbox["memory_cgroup_note"]
    assert sandbox["memory_cgroup"] is None or sandbox["memory_cgroup"].startswith("cgroup v")
    json.dumps(fp)  # JSON-able as captured


def test_git_fields_for_this_checkout(cpu_fingerprint):
    git = cpu_fingerprint["git"]
    head = subprocess.run(
        ["git", "-C", git["root"], "rev-parse", "--verify", "-q", "HEAD"],
        capture_output=True, check=False,
        text=True,
    )
    assert git["sha"] == (head.stdout.strip() if head.returncode == 0 else None)
    assert isinstance(git["dirty"], bool)
    assert (git["diff_sha256"] is None) == (not git["dirty"])


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    (repo / ".gitignore").write_text("ignored/\n")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    return repo


def test_git_clean_dirty_and_untracked_change_the_diff_hash(repo: Path):
    clean = capture_git(repo)
    assert clean["dirty"] is False and clean["diff_sha256"] is None and len(clean["sha"]) == 40

    (repo / "a.py").write_text("x = 2\n")
    edited = capture_git(repo)
    assert edited["dirty"] is True and edited["sha"] == clean["sha"]

    (repo / "new.py").write_text("y = 1\n")
    with_new = capture_git(repo)
    assert with_new["untracked_files"] == 1 and with_new["diff_sha256"] != edited["diff_sha256"]

    (repo / "new.py").write_text("y = 2\n")  # untracked content is part of the hash
    new_content = capture_git(repo)
    assert new_content["diff_sha256"] != with_new["diff_sha256"]

    (repo / "ignored").mkdir()
    (repo / "ignored" / "big.bin").write_bytes(b"\0" * 10)  # ignored files are not
    with_ignored = capture_git(repo)
    assert with_ignored["diff_sha256"] == new_content["diff_sha256"]
    assert with_ignored["untracked_files"] == 1


def test_declared_source_commit_is_recorded_beside_gits_own_state(tmp_path: Path, repo: Path):
    """A copy run elsewhere names its source commit; git's own (stale) answer stays."""
    own = capture_git(repo, {**os.environ, "MEGACPP_SOURCE_COMMIT": ""})
    assert "declared_commit" not in own
    declared = capture_git(repo, {**os.environ, "MEGACPP_SOURCE_COMMIT": " 99f80a6 \n"})
    assert declared == {**own, "declared_commit": "99f80a6"}
    plain = tmp_path / "plain"  # a copy without .git: git knows nothing, the claim remains
    plain.mkdir()
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tmp_path),
           "MEGACPP_SOURCE_COMMIT": "99f80a6"}
    assert capture_git(plain, env) == {"root": None, "sha": None, "dirty": None,
                                       "diff_sha256": None, "untracked_files": None,
                                       "declared_commit": "99f80a6"}


def test_git_is_null_outside_a_repo_and_without_git(tmp_path: Path, repo: Path):
    assert capture_git(tmp_path / "nowhere") is None
    plain = tmp_path / "plain"
    plain.mkdir()
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tmp_path)}
    assert capture_git(plain, env) is None
    no_git_path = {**os.environ, "PATH": str(tmp_path)}  # a PATH with no git on it
    assert capture_git(repo, no_git_path) is None


def test_git_checkout_without_history_has_no_sha(tmp_path: Path):
    vendored = tmp_path / "vendored"
    vendored.mkdir()
    _git(vendored, "init", "-q")
    (vendored / "code.py").write_text("pass\n")
    git = capture_git(vendored)
    assert git["sha"] is None and git["dirty"] is True and git["diff_sha256"] is not None


def test_capture_without_tools_on_path_is_null_not_a_crash(tmp_path: Path):
    env = {"PATH": str(tmp_path), "HOME": str(tmp_path)}
    tools = toolchain(env)
    assert tools["gcc"] is None and tools["gxx"] is None
    # like torch's cpp_extension, the CUDA toolkit is also looked for in /usr/local/cuda
    default_toolkit = Path("/usr/local/cuda/bin/nvcc").is_file()
    assert (tools["nvcc"] is not None) == default_toolkit
    fp = capture_fingerprint(env=env, project_root=tmp_path)
    assert fp["git"] is None and fp["toolchain"]["gcc"] is None and fp["env"] == {}


def test_real_gcc_version_when_present():
    gcc = toolchain(os.environ)["gcc"]
    if gcc is None:
        pytest.skip("no gcc on PATH")
    assert version_tuple(gcc, 1) >= (4,)


def test_contract_package_list_is_configurable_and_keeps_torch_and_triton():
    names = contract_packages(["NumPy", "megatron_core"])
    assert names == ["torch", "triton", "numpy", "megatron-core"]
    versions = package_versions(["numpy", "definitely-not-installed-pkg"])
    assert versions["numpy"] and versions["definitely-not-installed-pkg"] is None


def test_kernel_env_keeps_only_kernel_affecting_variables():
    env = {
        "TORCH_CUDA_ARCH_LIST": "9.0a",
        "TRITON_PTXAS_PATH": "/p",
        "NCCL_ALGO": "Ring",
        "TORCHINDUCTOR_MAX_AUTOTUNE": "1",
        "HOME": "/root",
        "PATH": "/bin",
    }
    assert kernel_env(env) == {
        "NCCL_ALGO": "Ring",
        "TORCHINDUCTOR_MAX_AUTOTUNE": "1",
        "TORCH_CUDA_ARCH_LIST": "9.0a",
        "TRITON_PTXAS_PATH": "/p",
    }


def test_load_fingerprint_fails_clearly(tmp_path: Path, cpu_fingerprint):
    good = tmp_path / "fp.json"
    good.write_text(json.dumps(cpu_fingerprint))
    assert load_fingerprint(good) == cpu_fingerprint
    truncated = tmp_path / "truncated.json"
    truncated.write_text(good.read_text()[:200])
    with pytest.raises(MegaCppError, match="not valid JSON.*truncated"):
        load_fingerprint(truncated)
    with pytest.raises(MegaCppError, match="does not exist"):
        load_fingerprint(tmp_path / "absent.json")
    other = tmp_path / "other.json"
    other.write_text('{"schema": "something-else"}')
    with pytest.raises(MegaCppError, match="not a megacpp fingerprint"):
        load_fingerprint(other)
    future = tmp_path / "future.json"
    future.write_text(json.dumps({**cpu_fingerprint, "schema_version": 99}))
    with pytest.raises(MegaCppError, match="schema_version 99"):
        load_fingerprint(future)
