"""The patch lane: predicates on injected facts, real in-memory apply and exact revert."""

from __future__ import annotations

import os

import pytest
import torch
import torch._inductor.utils as inductor_utils
from torch._inductor.ir import FixedLayout

from megacpp._io import sha256_file
from megacpp.contract import (
    applied_patches,
    apply_applicable,
    apply_patch,
    capture_fingerprint,
    patched,
)
from megacpp.contract.patches import PATCHES, get_patch, revert_all
from megacpp.errors import MegaCppError
from tests.contract.evidence_facts import gb10, h100


@pytest.fixture(autouse=True)
def no_patch_leaks():
    yield
    revert_all()


def test_inventory_entries_say_what_why_and_where():
    assert set(PATCHES) == {"triton-system-ptxas", "inductor-big-gpu"}
    for patch in PATCHES.values():
        assert patch.target and patch.reason and patch.upstream.startswith("https://")
    with pytest.raises(MegaCppError, match="known patches: triton-system-ptxas"):
        get_patch("nope")


def test_predicates_on_gb10_h100_and_this_cpu(cpu_facts):
    spark, hopper = gb10(cpu_facts), h100(cpu_facts)
    assert get_patch("triton-system-ptxas").applicability(spark).applies
    assert get_patch("inductor-big-gpu").applicability(spark).applies
    for facts in (hopper, cpu_facts):
        for patch in PATCHES.values():
            assert not patch.applicability(facts).applies
    assert "no CUDA device" in get_patch("inductor-big-gpu").applicability(cpu_facts).reason
    fixed = gb10(
        cpu_facts, triton="3.6.0", bundled={"ptxas": "12.8.93", "ptxas-blackwell": "12.9.86"}
    )
    assert "not needed" in get_patch("triton-system-ptxas").applicability(fixed).reason
    no_toolkit = gb10(cpu_facts, system_ptxas=None)
    assert "no system ptxas" in get_patch("triton-system-ptxas").applicability(no_toolkit).reason


def test_inductor_gate_is_lifted_in_memory_and_reverted_exactly(cpu_facts):
    original = inductor_utils.is_big_gpu
    source_file = inductor_utils.__file__
    before = sha256_file(source_file)
    layout = FixedLayout(device=torch.device("cuda", 0), dtype=torch.bfloat16, size=[64, 64])

    applied = apply_patch("inductor-big-gpu", gb10(cpu_facts))
    assert inductor_utils.is_big_gpu is not original
    # Inductor's real consumer of the gate now lets GEMM templates through for CUDA layouts
    assert inductor_utils._use_template_for_gpu(layout, [torch.bfloat16]) is True
    assert applied.record()["sm_counts"] == [48]
    assert [p["name"] for p in applied_patches()] == ["inductor-big-gpu"]
    assert [p["name"] for p in capture_fingerprint()["patches"]] == ["inductor-big-gpu"]

    applied.revert()
    assert inductor_utils.is_big_gpu is original and applied_patches() == []
    assert sha256_file(source_file) == before  # no file was written
    with pytest.raises(MegaCppError, match="already reverted"):
        applied.revert()


def test_patches_refuse_where_they_do_not_apply_and_twice(cpu_facts):
    with pytest.raises(MegaCppError, match="does not apply: not needed"):
        apply_patch("inductor-big-gpu", h100(cpu_facts))
    apply_patch("inductor-big-gpu", gb10(cpu_facts))
    with pytest.raises(MegaCppError, match="already applied"):
        apply_patch("inductor-big-gpu", gb10(cpu_facts))


def test_ptxas_routing_sets_and_restores_the_process_environment(cpu_facts, monkeypatch):
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    with patched(["triton-system-ptxas"], gb10(cpu_facts)) as (applied,):
        assert os.environ["TRITON_PTXAS_PATH"] == "/usr/local/cuda/bin/ptxas"
        assert applied.record()["env_var"] == "TRITON_PTXAS_PATH"
        assert applied.record()["previous"] is None
    assert "TRITON_PTXAS_PATH" not in os.environ

    monkeypatch.setenv("TRITON_PTXAS_PATH", "/opt/old/ptxas")  # an old value is put back
    spark = gb10(cpu_facts)  # captured before the variable was set: bundled ptxas in use
    with patched(["triton-system-ptxas"], spark):
        assert os.environ["TRITON_PTXAS_PATH"] == "/usr/local/cuda/bin/ptxas"
    assert os.environ["TRITON_PTXAS_PATH"] == "/opt/old/ptxas"


def test_apply_applicable_applies_exactly_the_predicates_that_hold(cpu_facts, monkeypatch):
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    assert apply_applicable(h100(cpu_facts)) == []
    names = [p.name for p in apply_applicable(gb10(cpu_facts))]
    assert names == ["triton-system-ptxas", "inductor-big-gpu"]
    revert_all()
    assert applied_patches() == [] and "TRITON_PTXAS_PATH" not in os.environ
