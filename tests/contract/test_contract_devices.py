"""Device profiles and MFU: the right peak, or n/a -- never another device's peak."""

from __future__ import annotations

import math

import pytest

from megacpp.contract import device_profile, mfu
from megacpp.contract.devices import known_profiles, profile_for_fingerprint
from megacpp.errors import MegaCppError
from tests.contract.evidence_facts import gb10, h100, with_gpu

REQUIRED = {
    "h100-sxm",
    "h100-pcie",
    "h200",
    "b200",
    "gb10",
    "rtx-5090",
    "a100-sxm-80gb",
    "l40s",
    "cpu",
}


def test_table_has_the_required_devices_and_a_source_for_every_figure():
    profiles = {p.key: p for p in known_profiles()}
    assert set(profiles) >= REQUIRED
    for profile in profiles.values():
        figures = {
            "sm_count": profile.sm_count,
            "max_smem_per_block_bytes": profile.max_smem_per_block_bytes,
            "memory_bandwidth_gbs": profile.memory_bandwidth_gbs,
            "peak_dense_tflops": profile.peak_dense_tflops or None,
            "compile_targets": profile.compile_targets or None,
        }
        for field, value in figures.items():
            if value is not None:
                assert profile.sources.get(field), f"{profile.key}.{field} has no source"


def test_gb10_profile_matches_the_dgx_spark():
    spark = device_profile("gb10")
    assert (spark.sm_count, spark.max_smem_per_block_bytes, spark.memory_bandwidth_gbs) == (
        48,
        99 * 1024,
        273,
    )
    assert "sm_121a" in spark.compile_targets and spark.arch == "sm_121"
    assert spark.peak("bf16") is None  # not published: MFU must be n/a, not an H100 guess


def test_lookup_by_key_name_and_live_device(cpu_facts):
    assert device_profile("NVIDIA GB10").key == "gb10"
    assert device_profile("NVIDIA H100 80GB HBM3").key == "h100-sxm"
    assert device_profile(None).key == "cpu"
    assert profile_for_fingerprint(gb10(cpu_facts)).key == "gb10"
    assert profile_for_fingerprint(cpu_facts).key == "cpu"
    with pytest.raises(MegaCppError, match="known devices: h100-sxm"):
        device_profile("H800")


def test_a_matching_name_with_a_different_sm_count_is_not_that_device(cpu_facts):
    cut_down = with_gpu(
        cpu_facts, name="NVIDIA H100 80GB HBM3", cc="9.0", sm_count=114, smem=232448
    )
    profile = profile_for_fingerprint(cut_down)
    assert profile.known is False and profile.sm_count == 114 and profile.peak("bf16") is None


def test_mfu_uses_the_devices_own_peak(cpu_facts):
    result = mfu(6e9, 50_000, profile_for_fingerprint(h100(cpu_facts)), dtype="bf16")
    assert math.isclose(result.achieved_tflops, 300.0)
    assert math.isclose(result.mfu, 300.0 / 989.4)


def test_mfu_is_na_for_unknown_peaks_and_never_borrows_one(cpu_facts):
    unknown = with_gpu(cpu_facts, name="NVIDIA Future GPU", cc="13.0", sm_count=64, smem=None)
    for profile in (
        profile_for_fingerprint(unknown),
        device_profile("gb10"),
        device_profile("cpu"),
    ):
        result = mfu(6e9, 5_000, profile, dtype="bf16")
        assert result.mfu is None and result.peak_tflops is None and "n/a" in result.peak_source


def test_mfu_with_a_user_peak_and_bad_inputs():
    result = mfu(1e9, 1_000, device_profile("gb10"), dtype="bf16", peak_tflops=100.0)
    assert math.isclose(result.mfu, 0.01) and "user" in result.peak_source
    for bad in ((0, 1), (1, -5), (float("nan"), 1)):
        with pytest.raises(MegaCppError, match="positive finite"):
            mfu(*bad, device_profile("h100-sxm"))
    with pytest.raises(MegaCppError, match="unknown dtype"):
        mfu(1, 1, device_profile("h100-sxm"), dtype="fp16x")
    with pytest.raises(MegaCppError, match="--peak"):
        mfu(1, 1, device_profile("h100-sxm"), peak_tflops=0)
