"""Mamba-3 backward with dx / dz / dD formed in _bwd_dqk (TUNING["fuse_dx"], session 20).

At the nam56r-350m step's shape (B 8, L 2048, 24 heads of headdim 64, d_state 64: one 32-pair
tile per head, so _bwd_dqk forms the scores over all pairs anyway), each setting's kernels'
CUDA time per forward+backward (profiler, mean of 10 calls after 3): fuse_dx 0 (_bwd_dx
launched, the old path), 1 (dx at the start of _bwd_dqk), 2 (at its end, the scores formed
again), each at 4 and 8 warps. Then the same settings' gradients against fuse_dx 0's (bf16:
max abs difference over each gradient's max abs).

    PYTHONPATH=$PWD/src python benchmarks/results/kernels/h100_s20/mamba3_fuse_probe.py OUT
"""

import copy
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from megacpp.kernels.ops.mamba3_scan import triton as M
from megacpp.kernels.registry import _mamba3_inputs

OUT = Path(sys.argv[1])
CASE = {"batch": 8, "seq": 2048, "groups": 1, "heads": 24, "d_state": 64, "headdim": 64,
        "angles": 16, "chunk": 64, "resets": 1, "final_state": 0}
GRADS = ("q", "k", "v", "adt", "dt", "trap", "q_bias", "k_bias", "angles", "D", "z")
SETTINGS = [  # (fuse_dx, launch options of the kernel that forms dx)
    (0, {}), (1, {}), (1, {"num_warps": 8}), (2, {}), (2, {"num_warps": 8}), (0, {}),
]


def main() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    inp = _mamba3_inputs(CASE, torch.bfloat16, dev, gen)
    cot = torch.randn(inp["v"].shape, device=dev, dtype=torch.bfloat16)

    def fwd_bwd():
        y, _ = M.mamba3_scan_triton(**inp)
        return torch.autograd.grad(y, [inp[n] for n in GRADS], cot)

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
                out[e.key[:40]] = out.get(e.key[:40], 0.0) + e.device_time_total / 10
        return out

    base = copy.deepcopy(M.TUNING)
    rows, grads = [], {}
    for fuse, launch in SETTINGS:
        M.TUNING.clear()
        M.TUNING.update(copy.deepcopy(base))
        M.TUNING["fuse_dx"] = fuse
        M.TUNING["launch"]["bwd_dqk_dx" if fuse else "bwd_dx"].update(launch)
        us = kernel_us()
        g = fwd_bwd()
        key = f"fuse{fuse}_{launch.get('num_warps', 4)}w"
        if key not in grads:
            grads[key] = g
        diff = {n: float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
                for n, a, b in zip(GRADS, g, grads["fuse0_4w"])}
        rows.append({"setting": key, "total_us": sum(us.values()), "us": us,
                     "max_rel_diff_vs_fuse0": max(diff.values()), "diff": diff})
        print(json.dumps({k: rows[-1][k] for k in ("setting", "total_us", "max_rel_diff_vs_fuse0")}),
              {k: round(v, 1) for k, v in us.items() if k.startswith("_")}, flush=True)
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "mamba3_fuse_probe.json").write_text(json.dumps(rows, indent=1))
    M.TUNING.clear()
    M.TUNING.update(base)


if __name__ == "__main__":
    main()
