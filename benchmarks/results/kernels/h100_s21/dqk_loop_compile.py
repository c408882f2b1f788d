"""Offline sm_90 compile of f418ed6's _bwd_dqk (the persistent-loop experiment), no GPU needed:
registers, spill-store bytes (Triton's bundled ptxas -v), cp.async and wgmma counts and shared
memory, for the grid kernel and the loop at 1-3 pipeline stages, at the nam56r step's shape
(N2B 32, RB 16) and the bench's (64, 32). Pointer arguments and the strides / lengths that are
multiples of 16 carry tt.divisibility 16, and G and the unit strides are constexpr, as at the
real launches (without those hints the grid kernel spills ~900 bytes instead of ~20).

    git worktree add /tmp/f418 f418ed6   # then copy this file into it
    cd /tmp/f418
    PYTHONPATH=TRITON:src:. python benchmarks/results/kernels/h100_s21/dqk_loop_compile.py
(TRITON: a Triton 3.6 with its bundled ptxas, e.g. ``pip install --no-deps --target /tmp/triton-cpu
triton==3.6.0`` on a machine without CUDA.)
"""

import re

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megacpp.kernels.ops.mamba3_scan import triton as M
from tests.kernels.test_triton_compile import _ptxas_spills

PTRS = {"Q": "*bf16", "K": "*bf16", "QBIAS": "*fp32", "KBIAS": "*fp32", "CS": "*fp16",
        "V": "*bf16", "Z": "*bf16", "DY": "*bf16", "SC": "*fp32", "RESET": "*i8", "SIN": "*bf16",
        "GST": "*bf16", "DQH": "*bf16", "DKH": "*bf16", "DQB": "*fp32", "DKB": "*fp32",
        "DELL": "*fp32", "DADT": "*fp32", "DSG": "*fp32"}
STRIDES = ["sv_b", "sv_l", "sv_h", "sz_b", "sz_l", "sz_h", "sy_b", "sy_l", "sy_h"]
INTS = [*STRIDES, "B", "L", "H", "NC", "P", "N", "R"]
DIV16 = [*STRIDES, "L", "NC", "P", "N", "R"]


def compile_one(n2b: int, rb: int, loop: bool, stages: int) -> str:
    const = {"T": 64, "BP": 64, "N2B": n2b, "RB": rb, "HAS_Z": True, "HAS_RESET": True,
             "DOT": tl.bfloat16, "JD": 32, "PAIRED": True, "LOOP": loop, "STAGES": stages,
             "G": 1, "sv_p": 1, "sz_p": 1, "sy_p": 1}
    sig = {**PTRS, **dict.fromkeys(INTS, "i32"), **dict.fromkeys(const, "constexpr")}
    names = list(M._bwd_dqk.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in [*PTRS, *DIV16]}
    kernel = triton.compile(ASTSource(fn=M._bwd_dqk, signature=sig, constexprs=const,
                                      attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4, "num_stages": 1})
    ptx = kernel.asm["ptx"]
    regs, spills = _ptxas_spills(kernel)
    return (f"N2B {n2b} loop {loop} stages {stages}: registers {regs}, spill stores {spills} B, "
            f"cp.async {len(re.findall(r'cp[.]async', ptx))}, "
            f"wgmma {len(re.findall('wgmma.mma_async', ptx))}, shared {kernel.metadata.shared} B")


if __name__ == "__main__":
    for n2b, rb in ((32, 16), (64, 32)):
        print(compile_one(n2b, rb, False, 1), flush=True)
        for stages in (1, 2, 3):
            print(compile_one(n2b, rb, True, stages), flush=True)
