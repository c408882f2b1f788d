"""Offline sm_90 compile of _bwd_dqk with pointer loads and with TMA loads (TUNING["dqk_tma"]),
no GPU needed: registers, spill-store bytes and shared memory (Triton's bundled ptxas -v) at the
nam56r step's shape (N2B 32, RB 16) and the bench's (64, 32), bf16, 64-token chunks, 4 warps,
as launched (tt.divisibility 16 on pointers and on the strides / lengths that are multiples of
16; G and the unit strides constexpr).

    PYTHONPATH=TRITON:src:. python benchmarks/results/kernels/h100_s33/dqk_tma_compile.py
(TRITON: a Triton 3.6 with its bundled ptxas, e.g. ``pip install --no-deps --target
/tmp/triton-cpu triton==3.6.0`` on a machine without CUDA.)
"""

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


def compile_one(n2b: int, rb: int, tma: bool, jd: int = 32, warps: int = 4) -> str:
    jd = min(jd, n2b)
    const = {"T": 64, "BP": 64, "N2B": n2b, "RB": rb, "HAS_Z": True, "HAS_RESET": True,
             "DOT": tl.bfloat16, "PAIRED": True, "TMA": tma, "JD": jd,
             "G": 1, "sv_p": 1, "sz_p": 1, "sy_p": 1}
    names = list(M._bwd_dqk.arg_names)
    ptrs = [n for n in names if n[0].isupper() and n not in const]
    sig = {n: ("*bf16" if n in BF16 else "*fp16" if n == "CS" else "*i8" if n == "RESET"
               else "*fp32") for n in ptrs}
    if tma:
        sig.update({n: "tensordesc<bf16[1, 64, 1, 64]>" for n in ("V", "Z", "DY")})
        sig.update({n: f"tensordesc<bf16[1, 64, {jd}]>" for n in ("SIN", "GST")})
    sig.update({**dict.fromkeys(INTS, "i32"), **dict.fromkeys(const, "constexpr")})
    div = [n for n in [*ptrs, *DIV16] if not sig[n].startswith("tensordesc")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div}
    compiled = triton.compile(
        ASTSource(fn=M._bwd_dqk, signature=sig, constexprs=const, attrs=attrs),
        target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 1})
    regs, spills = _ptxas_spills(compiled)
    return (f"_bwd_dqk N2B {n2b} tma {tma} warps {warps} pairs {jd}: registers {regs}, "
            f"spill stores {spills} B, shared {compiled.metadata.shared} B")


if __name__ == "__main__":
    for n2b, rb in ((32, 16), (64, 32)):
        for tma in (False, True):
            print(compile_one(n2b, rb, tma), flush=True)
