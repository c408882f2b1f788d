"""Offline register report of the Mamba-3 Triton kernels for sm_90 (no GPU needed): compile
each kernel with the benchmark's constexprs, pointer args 16-byte aligned, and read ptxas -v.
    PYTHONPATH=src:/tmp/triton-cpu python .device-carry/s10/regs.py [KERNEL ...] [--set k=v]"""
import inspect
import os
import re
import subprocess
import sys
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megacpp.kernels.ops.mamba3_scan import triton as mt

PTR = {"DT": "fp32", "ADT": "fp32", "DQB": "fp32", "DKB": "fp32", "DQ": "fp32", "DK": "fp32",
       "DADT": "fp32", "DSC": "fp32", "RESET": "i8", "SFIN": "fp32", "AFIN": "fp32",
       "DDP": "fp32", "QBIAS": "fp32", "KBIAS": "fp32", "DSKIP": "fp32"}
COMMON = {"T": 64, "BP": 64, "N2B": 64, "HAS_Z": True, "HAS_RESET": False, "HAS_D": True,
          "DOT": tl.bfloat16, "FAST": True, "STORE_YP": True, "LOAD_YP": True}
KERNELS = {
    "_bwd_qk": ("bwd_qk", {"JD": "qk_pairs"}),
    "_bwd_dx": ("bwd_dx", {}),
    "_out_fwd": ("out_fwd", {}),
    "_state_fwd": ("state_fwd", {"JB": "pairs"}),
    "_state_bwd": ("state_bwd", {"JB": "pairs"}),
}


def report(name):
    launch, tiles = KERNELS[name]
    fn = getattr(mt, name)
    params = list(inspect.signature(fn.fn).parameters)
    const = {k: v for k, v in COMMON.items() if k in params}
    const.update({k: mt.TUNING[v] for k, v in tiles.items()})
    if "PAIRED" in params:
        const["PAIRED"] = True
    if "CPB" in params:
        const["CPB"] = mt.TUNING["chunks_per_program"].get(launch, 1)
    sig, attrs = {}, {}
    for i, p in enumerate(params):
        if p in const:
            sig[p] = "constexpr"
        elif p.isupper() and len(p) > 1 or p in ("V", "Z", "Q", "K", "Y", "B_", "S"):
            sig[p] = "*" + PTR.get(p, "bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[p] = "i32"
    for p in ("B", "L", "H", "G", "NC", "P", "N", "R", "NJ", "HB"):
        if p in sig:
            sig[p] = "i32"
            attrs.pop((params.index(p),), None)
    for i, p in enumerate(params):
        if sig[p] == "i32":
            if p[0] == "s" and (p.endswith(("_p", "_n", "_r")) or p in ("sa_h", "sd_h", "st_h")):  # unit strides: specialized
                sig[p] = "constexpr"
                const[p] = 1
            elif p not in ("P", "N", "R", "G", "NJ", "HB"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, const, attrs)
    opts = dict(mt.TUNING["launch"][launch])
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    if os.environ.get("DUMP"):
        open(f"/tmp/{name}.ttgir", "w").write(k.asm["ttgir"])
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    ptxas = os.environ.get("TRITON_PTXAS_PATH") or os.path.join(
        os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    out = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"],
                         capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    print(f"{name:12s} warps {opts['num_warps']} regs {regs.group(1) if regs else '?'} "
          f"spill st/ld {spill.groups() if spill else '?'} smem {k.metadata.shared}")


if __name__ == "__main__":
    args = sys.argv[1:]
    names = [a for a in args if not a.startswith("--") and "=" not in a]
    for a in args:
        if "=" in a:
            key, val = a.lstrip("-").split("=")
            *path, last = key.split(".")
            d = mt.TUNING
            for part in path:
                d = d[part]
            d[last] = int(val)
    for name in names or KERNELS:
        report(name)
