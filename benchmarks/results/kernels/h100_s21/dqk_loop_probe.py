"""_bwd_dqk as a persistent, software-pipelined loop over its tiles (TUNING "dqk_loop" programs
per SM, "dqk_loop_stages") against the one-program-per-tile grid: the Mamba-3 scan's kernels'
CUDA time per forward+backward (profiler, mean of 10 calls after 3) at the nam56r step's shape
and the bench's, every setting in one process, the baseline first and last; gradients compared
with the baseline's (max abs difference).

    PYTHONPATH=$PWD/src python benchmarks/results/kernels/h100_s21/dqk_loop_probe.py OUT.jsonl
"""

import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from megacpp.kernels.ops.mamba3_scan import triton as M
from megacpp.kernels.registry import _mamba3_inputs

CASES = {
    "step": {"batch": 8, "seq": 2048, "groups": 1, "heads": 24, "d_state": 64, "headdim": 64,
             "angles": 16, "chunk": 64, "resets": 1, "final_state": 0},
    "bench": {"batch": 8, "seq": 4096, "groups": 1, "heads": 32, "d_state": 128, "headdim": 64,
              "angles": 32, "chunk": 64, "final_state": 0},
}
GRADS = ("q", "k", "v", "adt", "dt", "trap", "q_bias", "k_bias", "angles", "D", "z")
SETTINGS = [("grid", 0, 2), ("loop2_s1", 2, 1), ("loop2_s2", 2, 2), ("loop4_s1", 4, 1),
            ("loop2_s3", 2, 3), ("grid", 0, 2)]


def main() -> None:
    out = sys.argv[1]
    dev = torch.device("cuda")
    for name, case in CASES.items():
        gen = torch.Generator(device=dev).manual_seed(0)
        inp = _mamba3_inputs(case, torch.bfloat16, dev, gen)
        cot = torch.randn(inp["v"].shape, device=dev, dtype=torch.bfloat16, generator=gen)

        def fwd_bwd(inp=inp, cot=cot):
            y, _ = M.mamba3_scan_triton(**inp)
            return y, torch.autograd.grad(y, [inp[n] for n in GRADS], cot)

        base = None
        for label, loop, stages in SETTINGS:
            M.TUNING.update(dqk_loop=loop, dqk_loop_stages=stages)
            try:
                for _ in range(3):
                    fwd_bwd()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 -- a setting that fails is a result
                row = {"case": name, "setting": label, "error": f"{type(exc).__name__}: {exc}"[:300]}
                print(row, flush=True)
                with open(out, "a") as f:
                    f.write(json.dumps(row) + "\n")
                continue
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    fwd_bwd()
                torch.cuda.synchronize()
            us: dict[str, float] = {}
            for e in prof.key_averages():
                if e.device_type.name == "CUDA":
                    us[e.key[:40]] = us.get(e.key[:40], 0.0) + e.device_time_total / 10
            y, grads = fwd_bwd()
            outs = [y, *grads]
            if base is None:
                base = [t.clone() for t in outs]
            diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(outs, base))
            row = {"case": name, "setting": label, "total_us": sum(us.values()),
                   "bwd_dqk_us": us.get("_bwd_dqk", 0.0), "max_abs_diff_vs_grid": diff,
                   "us": us}
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(name, label, f"total {row['total_us']:.1f} bwd_dqk {row['bwd_dqk_us']:.1f}",
                  f"diff {diff:.3g}", flush=True)


if __name__ == "__main__":
    main()
