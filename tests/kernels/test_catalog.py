"""CPU: catalog rows, fail-closed selection, the check machinery, runtime modes, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from megacpp.errors import ConfigError
from megacpp.kernels import check as check_module
from megacpp.kernels import peers
from megacpp.kernels.catalog import (
    Backend,
    BackendUnsupported,
    Catalog,
    DeviceFacts,
    KernelSelectionError,
    Requirements,
    select,
    smem_needs,
)
from megacpp.kernels.check import CheckAborted, check_backend, check_catalog
from megacpp.kernels.ops.moe_experts.grouped import moe_experts_grouped
from megacpp.kernels.registry import default_catalog
from megacpp.kernels.runtime import chosen_kernels, kernel_mode_override, resolve, set_kernel_mode

H100 = DeviceFacts("cuda", "NVIDIA H100", (9, 0), 232448, frozenset({"triton"}),
                   frozenset({"_grouped_mm", "compile"}))
A100 = DeviceFacts("cuda", "NVIDIA A100", (8, 0), 166912, frozenset({"triton"}),
                   frozenset({"_grouped_mm", "compile"}))
CPU = DeviceFacts("cpu")


def test_every_surface_has_a_reference_and_documented_rows() -> None:
    catalog = default_catalog()
    for name in catalog.surfaces:
        assert len(catalog.of(name, "fallback")) == 1, name
    rows = {b.key: b for b in catalog.backends}
    for key in ("mamba3_scan/mamba_ssm", "mamba3_mimo_scan/mamba_ssm", "gated_delta/fla",
                "linear_cross_entropy/liger"):
        assert rows[key].role == "donor" and rows[key].reason
    for key in ("attention/flash_attn_3", "attention/flash_attn_4",
                "mamba3_mimo_scan/triton_chunked"):
        assert rows[key].role == "deferred" and rows[key].reason
    assert rows["attention/sdpa_flash"].role == "chosen"
    assert rows["mamba3_scan/triton_chunked"].role == "chosen"
    assert rows["mamba3_mimo_scan/triton_intra"].role == "chosen"
    assert rows["gated_delta/triton_chunked"].role == "chosen"


def test_every_required_package_is_probed() -> None:
    # a package a row requires but device_facts never looks for would reject the row everywhere
    from megacpp.kernels.catalog import PROBED_PACKAGES

    required = {p for b in default_catalog().backends for p in b.requirements.packages}
    assert required <= set(PROBED_PACKAGES), sorted(required - set(PROBED_PACKAGES))


def test_selection_on_hopper_picks_the_chosen_backends() -> None:
    catalog = default_catalog()
    picks = {s: select(catalog, s, H100, "bfloat16").backend.name
             for s in ("rmsnorm", "linear_cross_entropy", "moe_experts", "attention",
                       "mamba3_scan", "mamba3_mimo_scan", "gated_delta")}
    assert picks == {"rmsnorm": "triton_fused", "linear_cross_entropy": "triton_chunked",
                     "moe_experts": "grouped_mm", "attention": "sdpa_flash",
                     "mamba3_scan": "triton_chunked", "mamba3_mimo_scan": "triton_intra",
                     "gated_delta": "triton_chunked"}


def test_selection_fails_closed_listing_every_candidate() -> None:
    with pytest.raises(KernelSelectionError) as err:
        select(default_catalog(), "moe_experts", A100, "bfloat16")
    message = str(err.value)
    assert "grouped_mm: needs compute capability >= 9.0, have 8.0" in message
    assert "triton_grouped: deferred" in message
    with pytest.raises(KernelSelectionError, match="dtype float32 not in bfloat16"):
        select(default_catalog(), "moe_experts", H100, "float32")
    with pytest.raises(KernelSelectionError, match="needs device cuda, have cpu"):
        select(default_catalog(), "rmsnorm", CPU, "float32")


def test_allowed_fallback_records_the_rejections() -> None:
    sel = select(default_catalog(), "linear_cross_entropy", CPU, "float32", allow_reference=True)
    assert sel.fell_back and sel.backend.name == "reference"
    assert sel.to_dict()["rejected"] == [
        {"backend": "triton_chunked", "reason": "needs device cuda, have cpu"}]


def test_requirements_smem_packages_ops_and_bad_names() -> None:
    catalog = Catalog()
    catalog.add_surface(default_catalog().surface("rmsnorm"))
    catalog.add(Backend("big", "rmsnorm", "chosen", Requirements(smem_bytes=200 * 1024), abs))
    catalog.add(Backend("pkg", "rmsnorm", "chosen", Requirements(packages=("nope",)), abs))
    catalog.add(Backend("op", "rmsnorm", "chosen", Requirements(torch_ops=("_nope",)), abs))
    with pytest.raises(KernelSelectionError) as err:
        select(catalog, "rmsnorm", A100, "bfloat16")
    text = str(err.value)
    assert "needs 204800 B shared memory per block, device allows 166912" in text
    assert "package(s) not importable: nope" in text and "lacks torch._nope" in text
    roomy = DeviceFacts("cuda", "x", (9, 0), 232448, frozenset({"nope"}), frozenset({"_nope"}))
    assert select(catalog, "rmsnorm", roomy, "bfloat16").backend.name == "big"
    assert [k.smem_bytes for k in smem_needs([select(catalog, "rmsnorm", H100, "bfloat16")])] \
        == [200 * 1024]
    with pytest.raises(KernelSelectionError, match="unknown kernel surface 'nope'"):
        select(catalog, "nope", H100, "bfloat16")
    with pytest.raises(KernelSelectionError, match="dtype 'int8' not one of"):
        select(catalog, "rmsnorm", H100, "int8")
    with pytest.raises(ValueError, match="needs a reason"):
        catalog.add(Backend("peer", "rmsnorm", "donor", Requirements(), abs))


def _cpu_catalog(fn, name: str = "candidate", guard=None) -> tuple[Catalog, Backend]:
    catalog = Catalog()
    catalog.add_surface(default_catalog().surface("moe_experts"))
    backend = Backend(name, "moe_experts", "chosen", Requirements(devices=("cpu",)), fn,
                      check_guard=guard)
    catalog.add(backend)
    return catalog, backend


@pytest.mark.parametrize("seed", [0, 1])
def test_check_passes_a_real_alternative_implementation(seed: int) -> None:
    """The grouped-GEMM path runs on the CPU too (torch._grouped_mm, fp32): it must match."""
    catalog, backend = _cpu_catalog(moe_experts_grouped)
    result = check_backend(catalog.surface("moe_experts"), backend, torch.device("cpu"),
                           "float32", seed)
    assert result.passed, result.errors
    assert set(result.errors) == {"out", "dx", "dweights", "dw_in", "dw_out"}


def test_check_fails_a_wrong_or_nan_backend() -> None:
    def off_by_a_bit(**kw):
        return default_catalog().surface("moe_experts").reference(**kw) * 1.001

    def nan_out(**kw):
        return default_catalog().surface("moe_experts").reference(**kw) * float("nan")

    for fn in (off_by_a_bit, nan_out):
        catalog, backend = _cpu_catalog(fn)
        result = check_backend(catalog.surface("moe_experts"), backend, torch.device("cpu"),
                               "float32", 0)
        assert not result.passed


def _two_backend_catalog(first_fn, guard=None) -> Catalog:
    """moe_experts with two CPU candidates: ``first_fn`` (checked first) and the reference."""
    catalog, _ = _cpu_catalog(first_fn, "first", guard)
    catalog.add(Backend("second", "moe_experts", "chosen", Requirements(devices=("cpu",)),
                        catalog.surface("moe_experts").reference))
    return catalog


def test_check_records_a_raising_backend_and_goes_on() -> None:
    def raises(**kw):
        raise RuntimeError("boom\nsecond line")

    results = check_catalog(_two_backend_catalog(raises), torch.device("cpu"), CPU, ["float32"])
    assert [(r.backend, r.passed) for r in results] == [("first", False), ("second", True)]
    assert results[0].error == "RuntimeError: boom" and results[0].skipped is None


def test_check_stops_when_a_backend_leaves_the_device_unusable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An illegal address is sticky: the check stops after the backend that caused it, names
    it, and keeps the results so far (the device probe is what tells, so it is faked here)."""
    def faults(**kw):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    real_probe = check_module.device_usable
    monkeypatch.setattr(check_module, "device_usable", lambda device: False)
    seen = []
    with pytest.raises(CheckAborted, match=r"moe_experts/first \(float32\) failed with "
                       r"RuntimeError: CUDA error: an illegal memory access.*did not run") as exc:
        check_catalog(_two_backend_catalog(faults), torch.device("cpu"), CPU, ["float32"],
                      on_result=seen.append)
    assert [r.backend for r in exc.value.results] == ["first"] == [r.backend for r in seen]
    assert real_probe(torch.device("cpu"))  # the real probe, on the CPU


def test_cli_check_reports_the_error_and_the_abort(monkeypatch: pytest.MonkeyPatch) -> None:
    """`megacpp kernels check`: a raising backend is an ERROR row (exit 1, no traceback); one
    that leaves the device unusable ends the run with a one-line error after the table."""
    from typer.testing import CliRunner

    import megacpp.cli.kernels as cli

    def raises(**kw):
        raise ValueError("bad shapes")

    monkeypatch.setattr(cli, "default_catalog", lambda: _two_backend_catalog(raises))
    runner = CliRunner()
    ran = runner.invoke(cli.app, ["check", "--surface", "moe_experts", "--dtype", "float32"])
    assert ran.exit_code == 1
    assert "ERROR ValueError:" in ran.output and "bad shapes" in ran.output  # (cell wraps)
    assert "pass" in ran.output and "Traceback" not in ran.output  # the second backend ran
    monkeypatch.setattr(check_module, "device_usable", lambda device: False)
    stopped = runner.invoke(cli.app, ["check", "--surface", "moe_experts", "--dtype", "float32"])
    assert stopped.exit_code == 1 and "Traceback" not in stopped.output
    assert "error:" in stopped.output and "the remaining checks did not run" in stopped.output
    assert "second" not in stopped.output  # the run stopped after the failing backend


def test_check_guard_skips_a_backend_the_device_cannot_check() -> None:
    calls = []

    def never(**kw):
        calls.append(kw)
        raise AssertionError("a guarded backend must not run")

    catalog = _two_backend_catalog(never, guard=lambda facts: f"not on {facts.type}")
    results = check_catalog(catalog, torch.device("cpu"), CPU, ["float32"])
    assert results[0].skipped == "not on cpu" and not calls
    assert results[1].passed


def test_a_backend_that_refuses_the_inputs_is_skipped_with_its_reason() -> None:
    def narrower(**kw):
        raise BackendUnsupported("this peer takes no documents")

    results = check_catalog(_two_backend_catalog(narrower), torch.device("cpu"), CPU,
                            ["float32"])
    assert results[0].skipped == "this peer takes no documents" and results[0].error is None
    assert results[1].passed
    # the mamba_ssm adapter refuses packed documents before touching the peer (absent here)
    inputs = default_catalog().surface("mamba3_scan").make_inputs(
        {"batch": 1, "seq": 40, "groups": 1, "heads": 2, "d_state": 8, "headdim": 4,
         "angles": 2, "chunk": 16, "resets": 1}, torch.float32, torch.device("cpu"),
        torch.Generator().manual_seed(0))
    inputs["reset"][0, 20] = True
    with pytest.raises(BackendUnsupported, match="without packed documents"):
        peers.mamba3_siso_combined(**inputs)
    # so does the MIMO one, and a rotation it does not have (it rotates N/4 or N/2 pairs)
    mimo = default_catalog().surface("mamba3_mimo_scan")
    case = {**mimo.cases["check"], "seq": 40, "resets": 1}
    inputs = mimo.make_inputs(case, torch.float32, torch.device("cpu"),
                              torch.Generator().manual_seed(0))
    inputs["reset"][0, 20] = True
    with pytest.raises(BackendUnsupported, match="no packed-document reset"):
        peers.mamba3_mimo_tilelang(**inputs)
    inputs.pop("reset")
    inputs["angles"] = inputs["angles"][..., :3]
    with pytest.raises(BackendUnsupported, match="rotates N/2 or N/4 pairs; got 3"):
        peers.mamba3_mimo_tilelang(**inputs)


def test_fla_check_guard_names_hopper_with_triton_before_3_7_1(
        monkeypatch: pytest.MonkeyPatch) -> None:
    version = peers._version
    assert version("torch")[0] >= 2 and version("no-such-distribution") is None
    fla = next(b for b in default_catalog().of("gated_delta") if b.name == "fla")
    assert fla.check_guard is peers.fla_check_guard
    for triton, facts, refused in [((3, 6, 0), H100, True), ((3, 4, 0), H100, True),
                                   ((3, 7, 1), H100, False), ((3, 3, 1), H100, False),
                                   ((3, 6, 0), A100, False), (None, H100, False),
                                   ((3, 6, 0), CPU, False)]:
        monkeypatch.setattr(peers, "_version", lambda package, v=triton: v)
        why = peers.fla_check_guard(facts)
        assert (why is not None) == refused, (triton, facts.name)
        if refused:
            assert "fla issue 640" in why and ".".join(map(str, triton)) in why


def test_runtime_modes_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(2, 8)
    with kernel_mode_override("auto"):
        assert resolve("rmsnorm", x).name == "reference"
    with kernel_mode_override("fast"), pytest.raises(KernelSelectionError):
        resolve("rmsnorm", x)
    assert chosen_kernels()["rmsnorm"] == "reference"
    with pytest.raises(ConfigError, match="not one of reference, auto, fast"):
        set_kernel_mode("turbo")
    monkeypatch.setenv("MEGACPP_KERNELS", "bogus")
    with pytest.raises(ConfigError, match="MEGACPP_KERNELS='bogus'"):
        resolve("rmsnorm", x)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megacpp.cli.main", "kernels", *args],
                          capture_output=True, check=False, text=True, timeout=120)


def test_cli_list_json_and_bad_input(tmp_path) -> None:
    listed = _cli("list", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)["backends"]
    assert {"surface": "rmsnorm", "backend": "reference", "qualifies": True}.items() <= rows[1].items()
    table = _cli("list")  # the contracts' bracketed shapes print as text, not as rich markup
    assert table.returncode == 0, table.stderr
    flat = " ".join(table.stdout.split())
    assert "out [sum of matrices, rows, cols] (any float dtype" in flat
    assert "gram [batch, m, m] symmetric" in flat
    bad = _cli("check", "--dtype", "int8")
    assert bad.returncode == 2 and "unknown dtype(s) ['int8']" in bad.stderr + bad.stdout
    assert "Traceback" not in bad.stderr
    receipt = tmp_path / "bench.json"
    ok = _cli("bench", "--surface", "rmsnorm", "--repeats", "2", "--out", str(receipt))
    assert ok.returncode == 0, ok.stderr
    assert "rmsnorm/reference/ms" in json.loads(receipt.read_text())["metrics"]
    # a surface without autograd is timed by its forward, and says so
    fwd = _cli("bench", "--surface", "muon_polynomial", "--repeats", "2", "--out", str(receipt))
    assert fwd.returncode == 0, fwd.stderr
    assert "muon_polynomial/reference/ms" in json.loads(receipt.read_text())["metrics"]
    assert "│ fwd " in fwd.stdout


def test_lazy_backends_are_opaque_to_torch_compile() -> None:
    """A compiled model runs the catalog's lazily imported backends as they are (a graph
    break around each call) instead of tracing into their host code -- the H100 fast-path
    compiled training row failed inside Dynamo tracing a Triton op's launch code -- and gets
    the same values as eager."""
    from megacpp.kernels.declare import lazy
    from megacpp.kernels.ops.rmsnorm.reference import rmsnorm_reference

    backend = lazy("megacpp.kernels.ops.rmsnorm.reference", "rmsnorm_reference")
    x, w = torch.randn(4, 8, 16), torch.rand(16) + 0.5

    def f(x: torch.Tensor) -> torch.Tensor:
        return backend(x * 2, weight=w, eps=1e-6)[0] + 1

    torch._dynamo.reset()
    explained = torch._dynamo.explain(f)(x)
    assert explained.graph_break_count == 1  # the plain function would trace: 0 breaks
    compiled = torch.compile(f, backend="eager")
    torch.testing.assert_close(compiled(x), rmsnorm_reference(x * 2, weight=w, eps=1e-6)[0] + 1)
