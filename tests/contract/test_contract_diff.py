"""Classification of fingerprint differences: contract-breaking vs informational."""

from __future__ import annotations

import copy

import pytest

from megacpp.contract import contract_differences, diff_fingerprints, load_fingerprint
from megacpp.errors import MegaCppError
from tests.contract.evidence_facts import FIXTURES, gb10, h100


def _by_field(differences):
    return {d.field: d for d in differences}


def test_identical_fingerprints_have_no_differences(cpu_facts):
    assert diff_fingerprints(cpu_facts, copy.deepcopy(cpu_facts)) == []


def test_informational_fields_do_not_break_the_contract(cpu_facts):
    other = copy.deepcopy(cpu_facts)
    other["captured_at"] = "2030-01-01T00:00:00+00:00"
    other["host"]["hostname"] = "elsewhere"
    other["host"]["memory_bytes"] = 1
    other["git"] = {
        "root": "/x",
        "sha": "f" * 40,
        "dirty": False,
        "diff_sha256": None,
        "untracked_files": 0,
    }
    other["env"]["NCCL_DEBUG"] = "INFO"
    differences = diff_fingerprints(cpu_facts, other)
    assert differences and not any(d.contract for d in differences)
    assert {"captured_at", "host.hostname", "git.sha", "env.NCCL_DEBUG"} <= set(
        _by_field(differences)
    )


@pytest.mark.parametrize(
    ("field_path", "a", "b", "contract"),
    [
        (("packages", "torch"), "2.11.0+cu130", "2.11.0+cu128", False),  # same minor, build differs
        (("packages", "torch"), "2.11.0+cu130", "2.12.0+cu130", True),  # torch minor
        (("packages", "triton"), "3.6.0", "3.6.1", False),
        (("packages", "triton"), "3.5.0", "3.6.0", True),  # Triton minor
        (("packages", "numpy"), "2.4.6", "2.4.7", True),  # any other contract package
        (("torch", "cuda"), "12.8", "12.9", True),  # CUDA major.minor
        (("toolchain", "gcc"), "12.2.0", "12.3.0", False),
        (("toolchain", "gcc"), "12.2.0", "13.3.0", True),  # compiler major
        (("toolchain", "nvcc"), "12.9.86", "13.0.88", True),
        (("env", "TORCH_CUDA_ARCH_LIST"), None, "9.0a", True),
        (("python", "version"), "3.11.7", "3.12.3", True),
        (("sandbox", "memory_cgroup"), "cgroup v1 /sys/fs/cgroup/memory/a", None, False),
        (("sandbox", "seccomp"), True, False, False),
    ],
)
def test_classification_table(cpu_facts, field_path, a, b, contract):
    left, right = copy.deepcopy(cpu_facts), copy.deepcopy(cpu_facts)
    section, key = field_path
    for facts, value in ((left, a), (right, b)):
        if value is None:
            facts[section].pop(key, None)
        else:
            facts[section][key] = value
    (difference,) = diff_fingerprints(left, right)
    assert difference.field == f"{section}.{key}" and difference.contract is contract


def test_device_arch_and_count_break_the_contract_memory_does_not(cpu_facts):
    one_h100 = h100(cpu_facts)
    spark = gb10(cpu_facts)
    fields = _by_field(contract_differences(one_h100, spark))
    assert {"devices.0.arch", "devices.0.name", "devices.0.sm_count"} <= set(fields)
    two_h100 = h100(cpu_facts, count=2)
    assert "devices.count" in _by_field(contract_differences(one_h100, two_h100))
    bigger = copy.deepcopy(one_h100)
    bigger["devices"][0]["total_memory_bytes"] *= 2
    assert contract_differences(one_h100, bigger) == []


def test_patches_and_unknown_fields_break_the_contract(cpu_facts):
    patched = copy.deepcopy(cpu_facts)
    patched["patches"] = [{"name": "inductor-big-gpu", "target": "x", "applied_at": "t"}]
    assert [d.field for d in contract_differences(cpu_facts, patched)] == ["patches"]
    future = copy.deepcopy(cpu_facts)
    future["new_section"] = {"thing": 1}
    (difference,) = diff_fingerprints(cpu_facts, future)
    assert difference.contract and "fail closed" in difference.reason


def test_cpu_model_is_the_device_only_on_cpu_only_runs(cpu_facts):
    other = copy.deepcopy(cpu_facts)
    other["host"]["cpu_model"] = "Some Other CPU"
    assert _by_field(diff_fingerprints(cpu_facts, other))["host.cpu_model"].contract
    gpu_a, gpu_b = h100(cpu_facts), h100(other)
    assert not _by_field(diff_fingerprints(gpu_a, gpu_b))["host.cpu_model"].contract


def test_diff_refuses_non_fingerprints(cpu_facts):
    with pytest.raises(MegaCppError, match="not a megacpp fingerprint"):
        diff_fingerprints(cpu_facts, {"schema": "megacpp.receipt"})


def test_real_h100_fixture_against_this_cpu(cpu_facts):
    fixture = FIXTURES / "h100_fingerprint.json"
    if not fixture.is_file():
        pytest.skip("tests/contract/fixtures/h100_fingerprint.json not captured yet")
    gpu = load_fingerprint(fixture)
    assert gpu["accelerator"] == "cuda" and gpu["devices"][0]["arch"] == "sm_90"
    breaking = {d.field for d in contract_differences(cpu_facts, gpu)}
    assert {"accelerator", "devices.count", "torch.cuda"} <= breaking
