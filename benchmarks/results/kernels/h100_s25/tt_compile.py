"""Offline sm_90 compile of _bwd_dx and _bwd_dqk with and without TUNING["tt_in_dx"] (the
chunk's [T, T] work of d(q, k) in _bwd_dx, d_qk stored for _bwd_dqk's pair tiles), no GPU
needed: registers and spill-store bytes (Triton's bundled ptxas -v) at the nam56r step's shape
(N2B 32, RB 16) and the bench's (64, 32), bf16, 64-token chunks, 4 warps, as launched
(tt.divisibility 16 on pointers and on the strides / lengths that are multiples of 16; G and
the unit strides constexpr).

    PYTHONPATH=TRITON:src:. python benchmarks/results/kernels/h100_s25/tt_compile.py
(TRITON: a Triton 3.6 with its bundled ptxas, e.g. ``pip install --no-deps --target
/tmp/triton-cpu triton==3.6.0`` on a machine without CUDA.)
"""

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megacpp.kernels.ops.mamba3_scan import triton as M
from tests.kernels.test_triton_compile import _ptxas_spills

BF16 = ("Q", "K", "V", "Z", "DY", "SIN", "GST", "DQH", "DKH", "DQK", "YP", "DV", "DZ")
STRIDES = ["sv_b", "sv_l", "sv_h", "sz_b", "sz_l", "sz_h", "sy_b", "sy_l", "sy_h"]
INTS = [*STRIDES, "B", "L", "H", "NC", "P", "N", "R"]
DIV16 = [*STRIDES, "L", "NC", "P", "N", "R"]


def compile_one(kernel, n2b: int, rb: int, tt: bool, warps: int = 4, jd: int = 32) -> str:
    const = {"T": 64, "BP": 64, "N2B": n2b, "RB": rb, "HAS_Z": True, "HAS_RESET": True,
             "DOT": tl.bfloat16, "PAIRED": True, "TT": tt, "NS": max(1, n2b // jd) + tt,
             "G": 1, "sv_p": 1, "sz_p": 1, "sy_p": 1}
    if kernel is M._bwd_dqk:
        const["JD"] = min(jd, n2b)
    else:
        const.update(HAS_D=True, LOAD_YP=True)
    names = list(kernel.arg_names)
    ptrs = [n for n in names if n[0].isupper() and n not in const]
    sig = {n: ("*bf16" if n in BF16 else "*fp16" if n == "CS" else "*i8" if n == "RESET"
               else "*fp32") for n in ptrs}
    sig.update({**dict.fromkeys(INTS, "i32"), **dict.fromkeys(const, "constexpr")})
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in [*ptrs, *DIV16]}
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=const, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": 1})
    regs, spills = _ptxas_spills(compiled)
    return (f"{kernel.__name__} N2B {n2b} tt {tt} warps {warps} pairs {jd}: registers {regs}, spill stores {spills} B, "
            f"shared {compiled.metadata.shared} B")


if __name__ == "__main__":
    for n2b, rb in ((32, 16), (64, 32)):
        for kernel in (M._bwd_dx, M._bwd_dqk):
            for tt in (False, True):
                print(compile_one(kernel, n2b, rb, tt), flush=True)
        print(compile_one(M._bwd_dx, n2b, rb, True, 8), flush=True)
        for warps in (4, 8):
            print(compile_one(M._bwd_dqk, n2b, rb, True, warps, 64), flush=True)
        print(compile_one(M._bwd_dqk, n2b, rb, True, 8, 32), flush=True)
