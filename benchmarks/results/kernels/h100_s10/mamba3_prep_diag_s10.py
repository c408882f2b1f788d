"""Dev diagnostic (session 10): which part of the Mamba-3 _prep kernel costs its time? Times
_prep alone (do_bench median, bench shape B8 L4096 H32 N128 R32) for source variants of the
kernel module (written to /tmp), and checks each variant's QR/KR against the base.
    PYTHONPATH=$PWD/src:/tmp/site python3 benchmarks/results/kernels/h100_s10/mamba3_prep_diag_s10.py
(from the repository root, at 7e1b075: the variants are text edits of that kernel file)"""
import importlib.util
import json
import os
import sys

import torch
from triton.testing import do_bench

from megacpp.kernels.registry import _mamba3_inputs

SRC = open("src/megacpp/kernels/ops/mamba3_scan/triton.py").read()
CUM = "    ell = tl.cumsum(3.141592653589793 * th * dt[:, None], axis=0)  # [T, JB]\n"
TRI = ("    tri = (t[:, None] >= t[None, :]).to(tl.float32)\n"
       "    ell = tl.dot(tri, 3.141592653589793 * th * dt[:, None], input_precision=\"{p}\")\n")
VARIANTS = {
    "base": [],
    "no_ell_cumsum (wrong result)": [(CUM, "    ell = 3.141592653589793 * th * dt[:, None]\n")],
    "ell_by_dot_ieee": [(CUM, TRI.format(p="ieee"))],
    "ell_by_dot_tf32x3": [(CUM, TRI.format(p="tf32x3"))],
    "ell_by_dot_tf32": [(CUM, TRI.format(p="tf32"))],
    "no_trig (wrong result)": [("    cos, sin = _cos_sin(ell, FAST)\n    off =",
                                "    cos, sin = ell, ell\n    off =")],
    "no_scalar_cumsum (wrong result)": [("    return tl.cumsum(adt, axis=0), dt, gamma, scale",
                                         "    return adt, dt, gamma, scale")],
}


def load(name, edits):
    src = SRC
    for old, new in edits:
        assert old in src, (name, old)
        src = src.replace(old, new)
    path = f"/tmp/m3_{abs(hash(name))}.py"
    open(path, "w").write(src)
    spec = importlib.util.spec_from_file_location(f"m3v{abs(hash(name))}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    case = {"batch": 8, "seq": 4096, "groups": 1, "heads": 32, "d_state": 128, "headdim": 64,
            "angles": 32, "chunk": 64}
    gen = torch.Generator(device="cuda").manual_seed(0)
    inp = {k: (v.detach() if isinstance(v, torch.Tensor) else v)
           for k, v in _mamba3_inputs(case, torch.bfloat16, "cuda", gen).items()}
    rows, ref = [], None
    for name, edits in VARIANTS.items():
        mod = load(name, edits)
        q, k, v = inp["q"], inp["k"], inp["v"]
        geo = mod._geometry(q, v, inp["angles"], 64)
        dtype, _dot, fast = mod._precision(v)
        st = mod._common_strides(q, k, v, inp["z"], inp["adt"], inp["dt"], inp["trap"],
                                 inp["angles"], inp["q_bias"], inp["k_bias"])
        args = (q, k, v, inp["adt"], inp["dt"], inp["trap"], inp["angles"], inp["q_bias"],
                inp["k_bias"], inp["D"], inp["z"], None)
        ops = mod._prep_operands(geo, args, st, dtype, fast)
        err = None
        if ref is None:
            ref = ops
        else:
            err = max(float((a.float() - b.float()).norm() / b.float().norm())
                      for a, b in zip(ops, ref))
        us = 1000 * do_bench(lambda: mod._prep_operands(geo, args, st, dtype, fast),
                             warmup=10, rep=200, return_mode="median")
        regs = {n: (ck.n_regs, ck.n_spills) for c in mod._prep.device_caches.values()
                for n, ck in c[0].items()}
        row = {"variant": name, "prep_us": round(us, 1), "rel_err_vs_base": err,
               "regs_spills": list(regs.values())}
        print(json.dumps(row), flush=True)
        rows.append(row)
    json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "prep_diag.json"), "w"),
              indent=1)


if __name__ == "__main__":
    sys.exit(main())
