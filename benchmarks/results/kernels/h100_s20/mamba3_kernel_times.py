"""The Mamba-3 scan's kernels' CUDA time per forward+backward (profiler, mean of 10 calls after
3) at the nam56r step's shape and at the bench's, for whichever megacpp is on PYTHONPATH: run
it once per tree, alternately, in one device call (session 20: the [T, T] dot operands in bf16
before they are stored in registers, against 5885b98).

    PYTHONPATH=TREE/src python benchmarks/results/kernels/h100_s20/mamba3_kernel_times.py OUT.jsonl LABEL
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


def main() -> None:
    out, label = sys.argv[1], sys.argv[2]
    dev = torch.device("cuda")
    for name, case in CASES.items():
        gen = torch.Generator(device=dev).manual_seed(0)
        inp = _mamba3_inputs(case, torch.bfloat16, dev, gen)
        cot = torch.randn(inp["v"].shape, device=dev, dtype=torch.bfloat16, generator=gen)

        def fwd_bwd(inp=inp, cot=cot):
            y, _ = M.mamba3_scan_triton(**inp)
            return y, torch.autograd.grad(y, [inp[n] for n in GRADS], cot)

        for _ in range(3):
            fwd_bwd()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                fwd_bwd()
            torch.cuda.synchronize()
        us: dict[str, float] = {}
        for e in prof.key_averages():
            if e.device_type.name == "CUDA":
                us[e.key[:40]] = us.get(e.key[:40], 0.0) + e.device_time_total / 10
        y, grads = fwd_bwd()
        digest = [float(t.double().sum()) for t in (y, *grads)]  # same sums: same results
        row = {"label": label, "case": name, "total_us": sum(us.values()), "us": us,
               "digest": digest}
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(label, name, f"{row['total_us']:.1f}",
              {k: round(v, 1) for k, v in us.items() if k.startswith("_")}, flush=True)


if __name__ == "__main__":
    main()
