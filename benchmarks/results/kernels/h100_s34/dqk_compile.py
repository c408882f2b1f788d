"""Offline sm_90 compile of Mamba-3's _bwd_dqk (no GPU needed) at the bench's shape (N2B 64,
RB 32, bf16, 64-pair-wide P tile, resets, z): registers and spill-store bytes (Triton's bundled
ptxas -v), shared memory, and counts of what the kernel stages and waits on: layout conversions
and shared-memory operand stagings in the TTGIR, barriers (bar.sync) and mma / wgmma in the
PTX.

    PYTHONPATH=TRITON:src:. python benchmarks/results/kernels/h100_s34/dqk_compile.py \
        [KERNEL [T WARPS PAIRS]]

KERNEL: a kernel of the module (default _bwd_dqk; at 1e2b869 also _bwd_dqk_joined). With
DISABLE_MMA_V3=1 in the environment Triton uses mma.sync instead of wgmma (give it its own
TRITON_CACHE_DIR). Session 34's numbers: _bwd_dqk 255 registers, 20 bytes spilled, 111
barriers, 14 stagings; _bwd_dqk_joined 255, 92, 121, 9; DISABLE_MMA_V3 255, 136, 119; T 128 at
8 warps 832 bytes spilled (32 pairs), 480 (16 pairs). (TRITON: a Triton 3.6 with its bundled
ptxas, e.g. ``pip install --no-deps --target /tmp/tri triton==3.6.0``.)
"""

import re
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megacpp.kernels.ops.mamba3_scan import triton as M
from tests.kernels.test_triton_compile import _ptxas_spills

BF16 = ("Q", "K", "V", "Z", "DY", "SIN", "GST", "DQH", "DKH")
STRIDES = ["sv_b", "sv_l", "sv_h", "sz_b", "sz_l", "sz_h", "sy_b", "sy_l", "sy_h"]
INTS = [*STRIDES, "B", "L", "H", "NC", "P", "N", "R"]
DIV16 = [*STRIDES, "L", "NC", "P", "N", "R"]
COUNTS = {"convert_layout": ("ttgir", r"ttg\.convert_layout"),
          "operand stagings": ("ttgir", r"ttg\.local_alloc"),
          "bar.sync": ("ptx", r"bar\.sync"), "mma.sync": ("ptx", r"mma\.sync"),
          "wgmma": ("ptx", r"wgmma\.mma_async")}


def compile_stats(fn, t: int = 64, warps: int = 4, pairs: int = 32) -> str:
    const = {"T": t, "BP": 64, "N2B": 64, "RB": 32, "HAS_Z": True, "HAS_RESET": True,
             "DOT": tl.bfloat16, "PAIRED": True, "JD": pairs, "G": 1, "sv_p": 1, "sz_p": 1,
             "sy_p": 1}
    names = list(fn.arg_names)
    const = {k: v for k, v in const.items() if k in names}
    ptrs = [n for n in names if n[0].isupper() and n not in const]
    sig = {n: ("*bf16" if n in BF16 else "*fp16" if n == "CS" else "*i8" if n == "RESET"
               else "*fp32") for n in ptrs}
    sig.update({n: "i32" for n in INTS if n in names})
    sig.update(dict.fromkeys(const, "constexpr"))
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in [*ptrs, *DIV16] if n in names}
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": 1})
    regs, spills = _ptxas_spills(compiled)
    counts = ", ".join(f"{k} {len(re.findall(pat, compiled.asm[ir]))}"
                       for k, (ir, pat) in COUNTS.items())
    return (f"{fn.__name__} T {t} warps {warps} pairs {pairs}: registers {regs}, spill stores "
            f"{spills} B, shared {compiled.metadata.shared} B; {counts}")


if __name__ == "__main__":
    kernel = getattr(M, sys.argv[1] if len(sys.argv) > 1 else "_bwd_dqk")
    print(compile_stats(kernel, *map(int, sys.argv[2:5])), flush=True)
