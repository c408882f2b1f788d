"""Mamba-3 launch-setting sweep at the nam56r-350m training step's shape (dev record, session 15).

TUNING was swept at the bench's shape (L 4096, 32 heads, d_state 128); the step runs B 8,
L 2048, 24 heads of headdim 64, d_state 64 (16 rotated pairs), chunk 64, packed documents.
For each kernel and setting: the kernel's own CUDA time per forward+backward (profiler, mean of
10 calls), one setting changed at a time from the tree's TUNING.

    PYTHONPATH=$PWD/src:$PWD python benchmarks/results/kernels/h100_s15/mamba3_step_sweep.py OUT
        [combos|chunk [bench]]
Run 5 swept one setting at a time (SWEEP); "combos" times COMBOS (run 6) and "chunk"
CHUNK_COMBOS (run 8), each a list of changes made together, at the step's shape, or with
"bench" at the bench's (BENCH_CASE).
"""

import copy
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from megacpp.kernels.ops.mamba3_scan import triton as M
from megacpp.kernels.registry import _mamba3_inputs

OUT = Path(sys.argv[1])
CASE = {"batch": 8, "seq": 2048, "groups": 1, "heads": 24, "d_state": 64, "headdim": 64,
        "angles": 16, "chunk": 64, "resets": 1, "final_state": 0}
GRADS = ("q", "k", "v", "adt", "dt", "trap", "q_bias", "k_bias", "angles", "D", "z")
SWEEP = [  # (kernel, launch changes) ; kernel None: a TUNING key
    ("bwd_dqk", {"num_warps": 8}), ("bwd_dqk", {"num_stages": 2}),
    ("bwd_dqk", {"maxnreg": 168}), ("bwd_dqk", {"maxnreg": 200}),
    ("bwd_dqk", {"num_warps": 8, "num_stages": 2}), (None, {"dqk_pairs": 16}),
    ("bwd_dx", {"num_warps": 8}), ("bwd_dx", {"num_stages": 2}), ("bwd_dx", {"maxnreg": 128}),
    ("bwd_dx", {"maxnreg": 168}), ("bwd_dx", {"num_warps": 8, "num_stages": 2}),
    ("state_bwd", {"maxnreg": None}), ("state_bwd", {"maxnreg": 168}),
    ("state_bwd", {"num_stages": 3}), ("state_bwd", {"num_stages": 1}),
    ("state_bwd", {"num_warps": 8, "maxnreg": None}),
    ("out_fwd", {"maxnreg": None}), ("out_fwd", {"maxnreg": 128}), ("out_fwd", {"maxnreg": 200}),
    ("out_fwd", {"num_warps": 8, "maxnreg": None}), ("out_fwd", {"num_stages": 2}),
    ("state_fwd", {"num_stages": 2}), ("state_fwd", {"num_warps": 8}),
    ("state_fwd", {"num_stages": 4}), (None, {"pairs": 16}),
    ("prep", {"num_warps": 2}), ("prep", {"num_warps": 8}),
    ("bwd_tokens", {"num_warps": 2}), ("bwd_tokens", {"num_warps": 8}),
]
BENCH_CASE = {"batch": 8, "seq": 4096, "groups": 1, "heads": 32, "d_state": 128, "headdim": 64,
              "angles": 32, "chunk": 64, "final_state": 0}
COMBOS = [
    [(None, {"pairs": 16})],
    [(None, {"pairs": 16}), ("state_bwd", {"maxnreg": None})],
    [(None, {"pairs": 16}), ("state_bwd", {"maxnreg": None}), ("state_fwd", {"num_stages": 2})],
    [(None, {"pairs": 16}), ("state_bwd", {"maxnreg": None}), ("state_fwd", {"num_stages": 2}),
     ("out_fwd", {"maxnreg": 128})],
    [(None, {"pairs": 16}), ("state_bwd", {"maxnreg": None}), ("state_fwd", {"num_stages": 2}),
     ("out_fwd", {"maxnreg": 128}), ("prep", {"num_warps": 2})],
    [("out_fwd", {"maxnreg": 128})],
    [("prep", {"num_warps": 2})],
    [("state_fwd", {"num_stages": 2})],
    [("state_bwd", {"maxnreg": None})],
]
CHUNK_COMBOS = [  # run 8, on the tree's new settings: 32-token chunks at the step's shape
    [(None, {"max_chunk": 32})],
    [(None, {"max_chunk": 32}), ("bwd_dqk", {"num_warps": 2})],
    [(None, {"max_chunk": 32}), ("bwd_dx", {"num_warps": 2})],
    [(None, {"max_chunk": 32}), ("out_fwd", {"maxnreg": None})],
]
NAMES = {"bwd_dqk": "_bwd_dqk", "bwd_dx": "_bwd_dx", "state_bwd": "_state_bwd",
         "out_fwd": "_out_fwd", "state_fwd": "_state_fwd", "prep": "_prep",
         "bwd_tokens": "_bwd_tokens", "group_sum": "_group_sum"}


def main() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    combos = {"combos": COMBOS, "chunk": CHUNK_COMBOS}.get(sys.argv[2] if sys.argv[2:] else "")
    inp = _mamba3_inputs(BENCH_CASE if sys.argv[3:4] == ["bench"] else CASE, torch.bfloat16,
                         dev, gen)
    cot = torch.randn(inp["v"].shape, device=dev, dtype=torch.bfloat16)

    def fwd_bwd():
        y, _ = M.mamba3_scan_triton(**inp)
        torch.autograd.grad(y, [inp[n] for n in GRADS], cot)

    def kernel_us() -> dict[str, float]:
        for _ in range(3):
            fwd_bwd()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                fwd_bwd()
            torch.cuda.synchronize()
        out: dict[str, float] = {}
        for e in prof.key_averages():
            if e.device_type.name == "CUDA":
                out[e.key] = out.get(e.key, 0.0) + e.device_time_total / 10
        return out

    base_tuning = copy.deepcopy(M.TUNING)
    rows = []
    base = kernel_us()
    rows.append({"setting": "tree", "us": base, "total_us": sum(base.values())})
    print(json.dumps(rows[-1]), flush=True)
    start = time.time()
    for setting in combos or [[row] for row in SWEEP]:
        if time.time() - start > 420:
            break
        M.TUNING.clear()
        M.TUNING.update(copy.deepcopy(base_tuning))
        for kernel, change in setting:
            if kernel is None:
                M.TUNING.update(change)
            else:
                M.TUNING["launch"][kernel].update(change)
        kernel, change = setting[-1] if len(setting) == 1 else ("combo", setting)
        try:
            t = kernel_us()
        except Exception as exc:  # noqa: BLE001 -- a setting that fails is a result too
            rows.append({"kernel": kernel, "change": change, "error": str(exc)[:200]})
        else:
            rows.append({"kernel": kernel, "change": change, "us": t,
                         "total_us": sum(t.values())})
            if kernel in NAMES:
                rows[-1]["kernel_us"] = t.get(NAMES[kernel])
                rows[-1]["tree_kernel_us"] = base.get(NAMES[kernel])
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "us"}), flush=True)
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / f"mamba3_step_sweep{'_'.join(['', *sys.argv[2:]])}.json").write_text(json.dumps(rows, indent=1))
    M.TUNING.clear()
    M.TUNING.update(base_tuning)


if __name__ == "__main__":
    main()
