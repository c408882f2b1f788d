"""Offline register report of the gated delta Triton kernels for sm_90 (no GPU needed): each
kernel compiled with the H16 (K = V = 128) or nam56r (K 64, V 128) constexprs, bf16 inputs,
the default precision sets, pointer args 16-byte aligned; ptxas -v's registers and spills.
    TRITON_PTXAS_PATH=... PYTHONPATH=src:/tmp/triton-cpu python .device-carry/s9/gd_regs.py \
        [KERNEL ...] [--shape nam56r] [--set bwd_key.BKS=128]"""
import inspect
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megacpp.kernels.ops.gated_delta import triton as gd

FP32 = {"G", "BETA", "DIN", "DOUT", "GAM", "SCR", "VEC", "DB", "DG", "H0", "HT", "DHT", "DH0"}
STORE = {"U": "u", "VN": "v_new", "DVN": "dvn", "TM": "T", "DQK": "dqk", "DKP": "dk_part"}
SCALARS = {"L", "N", "scale"}


def report(name, shape):
    K, V = (128, 128) if shape == "h16" else (64, 128)
    fn = getattr(gd, "_" + name)
    params = list(inspect.signature(fn.fn).parameters)
    cfg = dict(gd.CONFIG[name])
    bv = cfg.pop("BV", 64)
    bks = min(cfg.pop("BKS", 64), K)
    nkb = -(-K // bks)
    const = {"H": 16 if shape == "h16" else 4, "DK": K, "DV": V, "BK": K, "BV": min(bv, V),
             "BT": 64, "SUB": 16, "HAS_RESET": False, "MODE": 3 if name in gd.BF16_PRODUCTS else 1,
             "SOLVE": 1, "HAS_H0": False, "STORE_HT": True, "HAS_DHT": False, "STORE_DH0": False,
             "N_CONST": 0, "BKS": bks, "NKB": nkb, "NS": 1 + nkb}
    sig, attrs, c = {}, {}, {}
    for i, p in enumerate(params):
        if p in const:
            sig[p] = "constexpr"
            c[p] = const[p]
        elif p in SCALARS:
            sig[p] = "fp32" if p == "scale" else "i32"
        else:
            if p == "RST":
                sig[p] = "*u8"
            elif p in FP32:
                sig[p] = "*fp32"
            elif p in STORE:
                sig[p] = "*bf16" if STORE[p] in gd.BF16_STORAGE else "*fp32"
            else:
                sig[p] = "*bf16"
            attrs[(i,)] = [["tt.divisibility", 16]]
    k = triton.compile(ASTSource(fn, sig, c, attrs), target=GPUTarget("cuda", 90, 32),
                       options=cfg)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    out = subprocess.run([os.environ["TRITON_PTXAS_PATH"], "-arch=sm_90a", "-v", f.name, "-o",
                          "/dev/null"], capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    print(f"{shape:6s} {name:13s} {gd.CONFIG[name]} regs {regs.group(1) if regs else '?'} "
          f"spill st/ld {spill.groups() if spill else out[-300:]} smem {k.metadata.shared}")


if __name__ == "__main__":
    args = sys.argv[1:]
    shape = "nam56r" if "--shape" in args and args[args.index("--shape") + 1] == "nam56r" else "h16"
    for a in args:
        if "=" in a:
            key, val = a.split("=")
            kern, field = key.split(".")
            gd.CONFIG[kern] = {**gd.CONFIG[kern], field: int(val)}
    names = [a for a in args if not a.startswith("--") and "=" not in a and a not in ("nam56r", "h16")]
    for name in names or gd.CONFIG:
        report(name, shape)
