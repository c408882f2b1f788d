"""On a real GPU (skipped elsewhere): capture, profile match, Triton ptxas routing."""

from __future__ import annotations

import os

import pytest

from megacpp.contract import PreflightInputs, capture_fingerprint, run_rules
from megacpp.contract.devices import profile_for_fingerprint
from megacpp.contract.patches import patched

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def live():
    return capture_fingerprint()


def test_live_capture_describes_the_gpu(live):
    device = live["devices"][0]
    assert live["accelerator"] == "cuda" and live["driver"]["version"]
    assert device["arch"].startswith("sm_") and device["sm_count"] > 0
    assert device["smem_per_block_optin_bytes"] >= 48 * 1024
    assert live["torch"]["cuda"] and live["driver"]["cuda_version"]


def test_known_gpu_matches_its_profile(live):
    profile = profile_for_fingerprint(live)
    if not profile.known:
        pytest.skip(f"{live['devices'][0]['name']} is not in devices.toml")
    assert profile.sm_count == live["devices"][0]["sm_count"]
    assert profile.max_smem_per_block_bytes == live["devices"][0]["smem_per_block_optin_bytes"]


def test_triton_ptxas_is_read_from_the_wheel_and_passes_preflight(live):
    if not live["triton"]:
        pytest.skip("Triton is not installed")
    assert live["triton"]["bundled_ptxas"]["ptxas"]["version"]
    report = run_rules(PreflightInputs(live))
    (finding,) = [f for f in report.findings if f.rule == "triton-ptxas-arch"]
    assert finding.severity == "pass"


def test_system_ptxas_routing_compiles_and_runs_a_triton_kernel(live):
    """Route Triton to the toolkit's ptxas with the real patch, then compile a kernel."""
    triton = pytest.importorskip("triton")
    import torch
    import triton.language as tl
    from triton import knobs

    system = live["toolchain"]["ptxas"]
    if not system or not live["triton"]:
        pytest.skip("needs Triton and a CUDA toolkit ptxas")
    old_wheel = {
        **live,
        "triton": {
            **live["triton"],
            "bundled_ptxas": {
                tool: {**entry, "version": "11.8.89"}  # as if the wheel's ptxas predated this arch
                for tool, entry in live["triton"]["bundled_ptxas"].items()
            },
        },
    }

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + 1, mask=mask)

    with patched(["triton-system-ptxas"], old_wheel) as (applied,):
        env_var = applied.record()["env_var"]
        assert os.environ[env_var] == system["path"]
        tool = (
            knobs.nvidia.ptxas_blackwell
            if env_var.endswith("BLACKWELL_PATH")
            else knobs.nvidia.ptxas
        )
        assert tool.path == system["path"]
        x = torch.zeros(1000, device="cuda")
        add_one[(4,)](x, 1000, BLOCK=256)
        torch.cuda.synchronize()
        assert torch.equal(x, torch.ones_like(x))
    assert env_var not in os.environ or os.environ[env_var] != system["path"]
