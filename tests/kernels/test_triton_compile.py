"""Our MoE and linear-CE Triton kernels compile for sm_90 (Hopper) without a GPU, at every
launch setting their configs ship.

Catches front-end errors (non-constexpr globals, bad casts, loop-carried types) and register
spills on machines that have Triton but no CUDA device; skipped where Triton is absent (CI).
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")


def _compile(fn, signature: dict, constexprs: dict, div16: tuple[str, ...] = (), **options):
    """``div16``: the arguments a launch at the shapes in question specializes as multiples of
    16 (pointers, sizes, strides), as Triton's launcher marks them (tt.divisibility): without
    the hints address arithmetic is not vectorized and the register counts are not the
    launch's (the gate|up + SwiGLU kernel at 128 x 128, 8 warps: 336 bytes spilled without,
    186 registers and none with)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    except RuntimeError as exc:  # no ptxas / backend in this Triton install
        if "ptxas" in str(exc).lower():
            pytest.skip(f"Triton cannot assemble for sm_90 here: {exc}")
        raise


def _ptxas_spills(kernel) -> tuple[int, int]:
    """(registers, spill store bytes) of a compiled kernel, from Triton's bundled ptxas -v."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("no bundled ptxas in this Triton install")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        run = subprocess.run([str(ptxas), "-v", "-arch=sm_90a", f.name, "-o", "/dev/null"],
                             capture_output=True, text=True, check=True)
    regs = int(re.search(r"Used (\d+) registers", run.stderr).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", run.stderr).group(1))
    return regs, spills


def test_linear_ce_kernels_compile_for_hopper():
    from megacpp.kernels.launch import DEFAULT
    from megacpp.kernels.ops.linear_cross_entropy import triton as lce
    from megacpp.kernels.ops.linear_cross_entropy.configs import CONFIGS

    for cfg in CONFIGS.values():
        assert DEFAULT in CONFIGS
        _compile(lce._ce_rows,
                 {"LOGITS": "*bf16", "LABELS": "*i64", "LOSS": "*fp32", "INV_N": "*fp32",
                  "n_rows": "i32", "stride": "i32", "ignore_index": "i32", "n_cols": "constexpr",
                  "BLOCK": "constexpr", "WRITE_GRAD": "constexpr"},
                 {"n_cols": 65536, "BLOCK": cfg.block, "WRITE_GRAD": True},
                 num_warps=cfg.num_warps)
    _compile(lce._scale_inplace, {"X": "*bf16", "SCALE": "*fp32", "n": "i64",
                                  "BLOCK": "constexpr"}, {"BLOCK": 4096})
    _compile(lce._scale_cast, {"SRC": "*fp32", "OUT": "*bf16", "SCALE": "*fp32", "n": "i64",
                               "BLOCK": "constexpr"}, {"BLOCK": 4096})


def test_moe_kernels_compile_for_hopper():
    from megacpp.kernels.launch import DEFAULT
    from megacpp.kernels.ops.moe_experts import dispatch, gemm, swiglu
    from megacpp.kernels.ops.moe_experts.configs import CONFIGS

    cfg = CONFIGS[DEFAULT]
    plan = {"E_PAD": 64, "BLOCK": cfg.plan_block, "SUB": 128}
    _compile(dispatch._expert_counts_kernel, {"IDS": "*i64", "COUNTS": "*i32", "n": "i32",
                                         **dict.fromkeys(plan, "constexpr")}, plan,
             num_warps=cfg.plan_warps)
    plan_scatter = {**plan, "RB": 64, "NB_CONST": 0}
    _compile(dispatch._plan_scatter_kernel,
             {"IDS": "*i64", "W": "*fp32", "COUNTS": "*i32", "ORDER": "*i64", "INV": "*i64",
              "W_SORTED": "*fp32", "OFFS": "*i32", "n": "i32", "n_blocks": "i32",
              "n_experts": "i32", **dict.fromkeys(plan_scatter, "constexpr")},
             plan_scatter, num_warps=cfg.plan_warps)
    scatter = {"K": 8, "BLOCK_T": cfg.scatter_tokens, "BLOCK_C": cfg.scatter_cols, "C_CONST": 0}
    _compile(dispatch._scatter_rows_kernel,
             {"SRC": "*bf16", "INV": "*i64", "OUT": "*bf16", "n_tokens": "i32", "n_cols": "i32",
              **dict.fromkeys(scatter, "constexpr")}, scatter, num_warps=cfg.scatter_warps)
    for has_add in (False, True):  # with the shared experts' output as the addend
        _compile(dispatch._gather_sum_kernel,
                 {"SRC": "*bf16", "INV": "*i64", "ADD": "*bf16", "OUT": "*bf16",
                  "n_cols": "i32", "K": "constexpr", "BLOCK": "constexpr",
                  "HAS_ADD": "constexpr"}, {"K": 8, "BLOCK": 1024, "HAS_ADD": has_add},
                 num_warps=cfg.gather_warps)
    rows = {"BLOCK_R": cfg.swiglu_elems // cfg.swiglu_cols, "BLOCK_F": cfg.swiglu_cols,
            "F_CONST": 0}
    _compile(swiglu._swiglu_fwd_kernel,
             {"GU": "*bf16", "W": "*fp32", "H": "*bf16", "n_rows": "i32", "ffn": "i32",
              "BLOCK_R": "constexpr", "BLOCK_F": "constexpr", "F_CONST": "constexpr"},
             rows, num_warps=cfg.swiglu_warps)
    _compile(swiglu._swiglu_bwd_kernel,
             {"GU": "*bf16", "W": "*fp32", "DH": "*bf16", "ORDER": "*i64", "DGU": "*bf16",
              "DW": "*fp32", "n_rows": "i32", "ffn": "i32", "BLOCK_R": "constexpr",
              "BLOCK_F": "constexpr", "F_CONST": "constexpr"}, rows,
             num_warps=cfg.swiglu_warps)
    for tile in cfg.wgrad:
        tiles = {"BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n, "BLOCK_K": tile.block_k}
        for out in ("fp32", "bf16"):  # float32 masters' gradients; bf16 weights'
            kernel = _compile(
                gemm._wgrad_kernel,
                {"A": f"tensordesc<bf16[{tile.block_k}, {tile.block_m}]>",
                 "B": f"tensordesc<bf16[{tile.block_k}, {tile.block_n}]>", "C": f"*{out}",
                 "OFFS": "*i32", "M": "i32", "N": "i32", "s_ce": "i32", "s_cm": "i32",
                 "s_cn": "i32", **dict.fromkeys(tiles, "constexpr")},
                tiles, num_warps=tile.num_warps, num_stages=tile.num_stages)
            assert "wgmma" in kernel.asm["ptx"]  # operands straight from tensor-memory loads
            regs, spills = _ptxas_spills(kernel)
            assert spills == 0 and regs <= 255, (tile, out, regs, spills)  # 205 at 128x256


def test_moe_grouped_mm_kernel_compiles_for_hopper():
    """Every launch setting the expert-GEMM kernel ships with, both layouts of W, and gate|up
    with the SwiGLU in its epilogue: wgmma from the tensor-memory loads, no register spills
    (per-element 64-bit output offsets of a 128 x 256 tile spilled 180 bytes)."""
    from megacpp.kernels.ops.moe_experts import gemm
    from megacpp.kernels.ops.moe_experts.configs import CONFIGS

    settings = [(tile, trans_b, False) for cfg in CONFIGS.values()
                for tile in cfg.grouped.values() for trans_b in (True, False)]
    settings += [(tile, True, True) for cfg in CONFIGS.values()
                 for tile in cfg.swiglu.values()]  # gate|up + SwiGLU
    for tile, trans_b, swiglu in settings:
        bm, bn, bk = tile.block_m, tile.block_n, tile.block_k
        w_block = f"[1, {bn}, {bk}]" if trans_b else f"[1, {bk}, {bn}]"
        const = {"TRANS_B": trans_b, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "E_PAD": 16,
                 "SWIGLU": swiglu}
        kernel = _compile(
            gemm._grouped_mm_kernel,
            {"A": f"tensordesc<bf16[{bm}, {bk}]>", "B": f"tensordesc<bf16{w_block}>",
             "C": "*bf16", "OFFS": "*i32", "WS": "*fp32", "H": "*bf16", "E": "i32", "N": "i32",
             "K": "i32", "s_cm": "i32", "s_hm": "i32", **dict.fromkeys(const, "constexpr")},
            # the MoE's shapes: 16-byte aligned allocations; N, K and the row strides are
            # multiples of 16 (ffn 272 / 512 / 2048, d 768 / 1024)
            const, ("C", "OFFS", "WS", "H", "N", "K", "s_cm", "s_hm"),
            num_warps=tile.num_warps, num_stages=tile.num_stages)
        assert "wgmma" in kernel.asm["ptx"], (tile, trans_b, swiglu)
        regs, spills = _ptxas_spills(kernel)
        assert spills == 0 and regs <= 255, (tile, trans_b, swiglu, regs, spills)
