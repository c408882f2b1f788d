"""Session-6 plan, one device call: the shipped Mamba-3 kernels vs the folded-_bwd_dqk dev copy
(register tile padded only) vs mamba_ssm, at the flagship's d_state 64 and the bench's 128.
    PYTHONPATH=$PWD/src:$PWD:$PWD/tests/kernels:/tmp/site python .device-carry/s6/probe6.py"""
import json
import os
import sys

import torch

sys.path.insert(0, ".device-carry/s6")
import mamba3_folded as mf  # noqa: E402
import test_mamba3_triton as tm  # noqa: E402

from megacpp.kernels.ops.mamba3_scan import triton as mt  # noqa: E402
from megacpp.kernels.registry import _mamba3_inputs  # noqa: E402
from megacpp.kernels.timing import time_fwd_bwd  # noqa: E402

GRADS = ("q", "k", "v", "adt", "dt", "trap", "q_bias", "k_bias", "angles", "D", "z")
OUT = os.environ.get("OUT", "/tmp")
rows = []


def say(row):
    print(json.dumps(row), flush=True)
    rows.append(row)


for name, fn in (("shipped", mt.mamba3_scan_triton), ("folded", mf.mamba3_scan_triton)):
    for case in ((2, 300, 1, 4, 64, 64, 16, 64, True), (1, 200, 1, 2, 32, 64, 16, 64, False),
                 (2, 300, 1, 4, 128, 64, 32, 64, True)):
        *shape, chunk, reset = case
        inputs, rst = tm.make_inputs(*shape, dtype=torch.bfloat16, device="cuda", seed=5,
                                     with_reset=reset)
        try:
            err = tm.compare(fn, inputs, rst, chunk, 1e-2)
            say({"check": name, "case": case, "max_err": max(err.values())})
        except Exception as e:  # noqa: BLE001 -- a fault poisons the context: stop
            say({"check": name, "case": case, "error": str(e)[:300]})
            if "illegal" in str(e):
                sys.exit(1)
from megacpp.kernels.peers import mamba3_siso_combined  # noqa: E402

for d_state, heads, angles in ((64, 24, 16), (128, 32, 32)):
    spec = {"batch": 8, "seq": 4096, "groups": 1, "heads": heads, "d_state": d_state,
            "headdim": 64, "angles": angles, "chunk": 64}
    for name, fn in (("shipped", mt.mamba3_scan_triton), ("folded", mf.mamba3_scan_triton),
                     ("mamba_ssm", mamba3_siso_combined), ("shipped", mt.mamba3_scan_triton)):
        gen = torch.Generator(device="cuda").manual_seed(0)
        inputs = _mamba3_inputs(spec, torch.bfloat16, "cuda", gen)
        t = time_fwd_bwd(fn, inputs, GRADS, torch.device("cuda"), warmup=2, repeats=7)
        say({"time": name, "d_state": d_state, "heads": heads, "ms": round(t.median_ms, 3),
             "peak_gib": round((t.peak_extra_bytes or 0) / 2**30, 3)})
        del inputs
        torch.cuda.empty_cache()
json.dump(rows, open(f"{OUT}/probe6.json", "w"), indent=1)
