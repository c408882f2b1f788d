"""Preflight rules on injected device facts (GB10, H100, ...) on a CPU machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megacpp.contract import (
    KernelSmem,
    PreflightError,
    PreflightInputs,
    load_contract_config,
    require_preflight,
    run_rules,
    verify_site,
)
from megacpp.contract.config import parse_kernel_option
from megacpp.contract.preflight import (
    ROUTING_FILE,
    read_cache_routings,
    record_cache_routings,
    triton_cache_dir,
)
from megacpp.errors import ConfigError, MegaCppError
from tests.contract.evidence_facts import gb10, h100, with_gpu


def findings(facts, rule, **inputs):
    report = run_rules(PreflightInputs(facts=facts, **inputs))
    return [f for f in report.findings if f.rule == rule]


def severities(facts, rule, **inputs):
    return [f.severity for f in findings(facts, rule, **inputs)]


# --- (a) kernel shared memory ---------------------------------------------------------------


def test_kernel_over_the_gb10_per_block_limit_is_an_error(cpu_facts):
    kernels = [KernelSmem("mamba3_chunk_scan_fwd", 132 * 1024), KernelSmem("small", 64 * 1024)]
    (finding,) = findings(gb10(cpu_facts), "kernel-smem", kernels=kernels)
    assert finding.severity == "error"
    assert "132 KiB" in finding.message and "99 KiB" in finding.message
    assert "mamba3_chunk_scan_fwd" in finding.message
    assert severities(h100(cpu_facts), "kernel-smem", kernels=kernels) == ["pass"]


def test_kernel_limit_falls_back_to_the_profile_then_warns(cpu_facts):
    kernels = [KernelSmem("big", 200 * 1024)]
    no_query = gb10(cpu_facts)
    no_query["devices"][0]["smem_per_block_optin_bytes"] = None  # profile says 99 KiB
    assert severities(no_query, "kernel-smem", kernels=kernels) == ["error"]
    unknown = with_gpu(cpu_facts, name="NVIDIA Future", cc="13.0", sm_count=60, smem=None)
    assert severities(unknown, "kernel-smem", kernels=kernels) == ["warning"]
    assert severities(gb10(cpu_facts), "kernel-smem") == ["n/a"]


def test_kernel_needs_from_config_and_command_line(tmp_path: Path):
    config = tmp_path / "run.toml"
    config.write_text(
        '[preflight]\nskip = ["device-profile"]\n'
        '[[preflight.kernels]]\nname = "attn_fwd"\nsmem_bytes = 131072\n'
        '[contract]\nextra_packages = ["my-kernels"]\n'
    )
    loaded = load_contract_config(config)
    assert loaded.kernels == (KernelSmem("attn_fwd", 131072),) and loaded.skip == (
        "device-profile",
    )
    assert loaded.packages[:2] == ("torch", "triton") and "my-kernels" in loaded.packages
    assert parse_kernel_option("attn=100KiB") == KernelSmem("attn", 102400)
    with pytest.raises(ConfigError, match="NAME=BYTES"):
        parse_kernel_option("attn")
    config.write_text('[[preflight.kernels]]\nname = "x"\nsmem_bytes = "lots"\n')
    with pytest.raises(ConfigError, match="smem_bytes"):
        load_contract_config(config)
    config.write_text("[preflight\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_contract_config(config)


# --- (b) Triton's ptxas vs the arch ------------------------------------------------------------


def test_gb10_with_triton_35_bundled_ptxas_is_an_error_with_the_system_ptxas_fix(cpu_facts):
    (finding,) = findings(gb10(cpu_facts), "triton-ptxas-arch")
    assert finding.severity == "error"
    assert (
        "sm_121a" in finding.message and "12.8.93" in finding.message and "12.9" in finding.message
    )
    assert "TRITON_PTXAS_PATH=/usr/local/cuda/bin/ptxas" in finding.fix


def test_gb10_routed_to_a_cuda_13_ptxas_passes(cpu_facts):
    routed = gb10(cpu_facts, env={"TRITON_PTXAS_PATH": "/usr/local/cuda/bin/ptxas"})
    assert severities(routed, "triton-ptxas-arch") == ["pass"]


def test_gb10_without_a_usable_system_ptxas_says_install_a_toolkit(cpu_facts):
    (finding,) = findings(gb10(cpu_facts, system_ptxas="12.8.61"), "triton-ptxas-arch")
    assert finding.severity == "error" and "install a CUDA toolkit >= 12.9" in finding.fix


def test_triton_36_uses_ptxas_blackwell_and_ignores_triton_ptxas_path(cpu_facts):
    bundled = {"ptxas": "12.8.93", "ptxas-blackwell": "12.9.86"}
    assert severities(gb10(cpu_facts, triton="3.6.0", bundled=bundled), "triton-ptxas-arch") == [
        "pass"
    ]
    misleading = gb10(
        cpu_facts,
        triton="3.6.0",
        bundled=bundled,
        env={"TRITON_PTXAS_PATH": "/usr/local/cuda/bin/ptxas"},
    )
    (finding,) = findings(misleading, "triton-ptxas-arch")
    assert finding.severity == "warning" and "TRITON_PTXAS_BLACKWELL_PATH" in finding.fix


def test_ptxas_version_from_the_triton_table_or_unknown(cpu_facts):
    from_table = gb10(cpu_facts, triton="3.5.0", bundled={})  # binary not captured: table says 12.8
    assert severities(from_table, "triton-ptxas-arch") == ["error"]
    unknown = gb10(cpu_facts, triton="3.1.0", bundled={})
    assert severities(unknown, "triton-ptxas-arch") == ["warning"]
    assert severities(h100(cpu_facts), "triton-ptxas-arch") == ["pass"]
    assert severities(gb10(cpu_facts, triton=None), "triton-ptxas-arch") == ["n/a"]


# --- (c) Inductor's big-GPU gate -----------------------------------------------------------------


def test_inductor_gate_warns_on_small_gpus_and_says_the_hardware_is_unchanged(cpu_facts):
    (finding,) = findings(gb10(cpu_facts), "inductor-big-gpu-gate")
    assert finding.severity == "warning" and "48 SMs" in finding.message
    assert "does not change the hardware" in finding.fix
    lifted = gb10(cpu_facts)
    lifted["patches"] = [{"name": "inductor-big-gpu", "target": "x", "applied_at": "t"}]
    (info,) = findings(lifted, "inductor-big-gpu-gate")
    assert info.severity == "info" and "still 48 SMs" in info.message
    assert severities(h100(cpu_facts), "inductor-big-gpu-gate") == ["n/a"]


# --- (d) one Triton cache, two ptxas routings ----------------------------------------------------


def test_shared_triton_cache_between_routings_is_flagged(cpu_facts, tmp_path: Path):
    cache = tmp_path / "triton-cache"
    bundled = gb10(
        cpu_facts,
        triton="3.6.0",
        bundled={"ptxas": "12.8.93", "ptxas-blackwell": "12.9.86"},
        env={"TRITON_CACHE_DIR": str(cache)},
    )
    assert triton_cache_dir(bundled) == cache and read_cache_routings(bundled) is None
    record_cache_routings(bundled)
    assert json.loads((cache / ROUTING_FILE).read_text())["routings"][0]["target"] == "sm_121a"
    same = read_cache_routings(bundled)
    assert severities(bundled, "triton-cache-routing", cache_routings=same) == ["pass"]

    system = gb10(
        cpu_facts,
        triton="3.6.0",
        bundled={"ptxas": "12.8.93", "ptxas-blackwell": "12.9.86"},
        env={
            "TRITON_CACHE_DIR": str(cache),
            "TRITON_PTXAS_BLACKWELL_PATH": "/usr/local/cuda/bin/ptxas",
        },
    )
    (finding,) = findings(
        system, "triton-cache-routing", cache_routings=read_cache_routings(system)
    )
    assert finding.severity == "warning" and "12.9.86" in finding.message
    assert "TRITON_CACHE_DIR=" in finding.fix and str(cache) in finding.message

    (cache / ROUTING_FILE).write_text("{truncated")
    with pytest.raises(MegaCppError, match="delete it"):
        read_cache_routings(system)


# --- (e) CUDA runtime vs driver ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("torch_cuda", "driver", "driver_cuda", "expected"),
    [
        ("13.0", "580.95.05", "13.0", "pass"),
        ("13.0", "575.51.03", "12.9", "error"),  # new major: cannot run
        ("12.9", "570.86.10", "12.8", "warning"),  # minor version compatibility
        ("12.9", "575.51.03", None, "pass"),  # driver's CUDA derived from the table
        ("13.0", "570.86.10", None, "error"),
        ("13.9", "590.44.01", None, "warning"),  # beyond the table: cannot tell
    ],
)
def test_cuda_runtime_against_driver(cpu_facts, torch_cuda, driver, driver_cuda, expected):
    facts = h100(cpu_facts, torch_cuda=torch_cuda, driver=driver, driver_cuda=driver_cuda)
    (finding,) = findings(facts, "cuda-driver")
    assert finding.severity == expected
    if expected == "error" and driver_cuda is None:
        assert "580.65.06" in finding.message  # the table's minimum for CUDA 13.0


def test_cuda_driver_rule_is_na_on_cpu_torch(cpu_facts):
    assert severities(cpu_facts, "cuda-driver") == ["n/a"]


# --- (f) contract packages modified in place -----------------------------------------------------


def test_modified_contract_package_is_an_error_and_unexpected_file_a_warning(
    cpu_facts, installed_site: Path
):
    (clean,) = verify_site(["tabulate"], path=installed_site)
    assert severities(cpu_facts, "site-integrity", integrity=[clean]) == ["pass"]
    (installed_site / "tabulate" / "hotfix.py").write_text("x = 1\n")
    (extra,) = verify_site(["tabulate"], path=installed_site)
    assert severities(cpu_facts, "site-integrity", integrity=[extra]) == ["warning"]
    module = installed_site / "tabulate" / "__init__.py"
    module.write_text(module.read_text() + "\n# edited in place\n")
    (edited,) = verify_site(["tabulate"], path=installed_site)
    (finding,) = findings(cpu_facts, "site-integrity", integrity=[edited])
    assert finding.severity == "error" and "tabulate/__init__.py" in finding.message
    assert "--force-reinstall" in finding.fix
    assert severities(cpu_facts, "site-integrity") == ["n/a"]


# --- running, skipping, refusing -----------------------------------------------------------------


def test_skipping_rules_is_recorded_and_unknown_rules_are_refused(cpu_facts):
    facts = gb10(cpu_facts)
    report = run_rules(PreflightInputs(facts), skip=["triton-ptxas-arch"])
    assert report.ok and report.skipped == ["triton-ptxas-arch"]
    assert report.to_dict()["skipped"] == ["triton-ptxas-arch"]
    assert not run_rules(PreflightInputs(facts)).ok
    with pytest.raises(MegaCppError, match="unknown preflight rule.*no-such-rule"):
        run_rules(PreflightInputs(facts), skip=["no-such-rule"])


def test_require_preflight_refuses_then_runs_when_the_rule_is_named(cpu_facts, tmp_path: Path):
    facts = gb10(cpu_facts, env={"TRITON_CACHE_DIR": str(tmp_path / "cache")})
    config = load_contract_config(None)
    lean = type(config)(packages=("tokenizers",), skip=(), kernels=())
    with pytest.raises(PreflightError, match="--skip-preflight triton-ptxas-arch") as refused:
        require_preflight(facts, lean)
    assert refused.value.exit_code == 2 and "sm_121a" in str(refused.value)
    report = require_preflight(facts, lean, skip=["triton-ptxas-arch"])
    assert report.skipped == ["triton-ptxas-arch"]
    assert (tmp_path / "cache" / ROUTING_FILE).is_file()  # routing recorded once it passed


# --- (h) the C++ sandbox's host guarantees ---------------------------------------------------


def _sandbox(cpu_facts, **changes):
    facts = json.loads(json.dumps(cpu_facts))
    facts["sandbox"] = {"seccomp": True, "user_namespaces": 15000,
                        "memory_cgroup": "cgroup v2 /sys/fs/cgroup/eval",
                        "memory_cgroup_note": "chosen by MEGACPP_SANDBOX_CGROUP=/sys/fs/cgroup/eval",
                        **changes}
    return facts


def test_sandbox_host_passes_when_every_guarantee_is_there(cpu_facts):
    assert severities(_sandbox(cpu_facts), "sandbox-host") == ["pass"]
    no_section = json.loads(json.dumps(cpu_facts))
    no_section.pop("sandbox", None)
    assert severities(no_section, "sandbox-host") == ["n/a"]


@pytest.mark.parametrize(("changes", "says"), [
    ({"seccomp": False}, "no seccomp filters"),
    ({"memory_cgroup": None, "memory_cgroup_note": "cgroup v1 memory: this cgroup is not "
                                                   "writable"}, "this cgroup is not writable"),
    ({"user_namespaces": 0}, "max_user_namespaces is 0"),
])
def test_sandbox_host_warns_once_per_missing_guarantee(cpu_facts, changes, says):
    (finding,) = findings(_sandbox(cpu_facts, **changes), "sandbox-host")
    assert finding.severity == "warning" and says in finding.message and finding.fix
    assert "\n" not in finding.message


def test_the_live_fingerprint_feeds_the_sandbox_rule(cpu_facts):
    (finding, *_) = findings(cpu_facts, "sandbox-host")
    assert finding.severity in ("pass", "warning")
