"""The Mamba-3 scan's launch settings for _bwd_dqk (pairs per program, warps) and the chunk
length cap, swept at the bench's shape (B 8, L 4096, 32 heads of d_state 128, one group) and
the nam56r-350m step's (B 8, L 2048, 24 heads of d_state 64, resets): each kernel's CUDA time
per forward+backward (profiler, mean of 10 calls after 3), the whole call (CUDA events around
10 back to back, median of 5), and the largest relative error of the output and the 11
gradients against the shipped setting's. Writes OUT.json and a bench receipt.

    PYTHONPATH=src python benchmarks/results/kernels/h100_s24/mamba3_dqk_sweep.py OUT.json
"""

import copy
import json
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from megacpp.kernels.ops.mamba3_scan import triton as M
from megacpp.kernels.registry import _mamba3_inputs
from megacpp.receipts import write_receipt

CASES = {
    "bench": {"batch": 8, "seq": 4096, "groups": 1, "heads": 32, "d_state": 128, "headdim": 64,
              "angles": 32, "chunk": 64, "final_state": 0},
    "step": {"batch": 8, "seq": 2048, "groups": 1, "heads": 24, "d_state": 64, "headdim": 64,
             "angles": 16, "chunk": 64, "resets": 1, "final_state": 0},
}
GRADS = ("q", "k", "v", "adt", "dt", "trap", "q_bias", "k_bias", "angles", "D", "z")
SETTINGS = {  # name -> (dqk_pairs, bwd_dqk launch, max_chunk)
    "shipped": (32, {"num_warps": 4, "num_stages": 1}, 64),
    "pairs64_w8": (64, {"num_warps": 8, "num_stages": 1}, 64),
    "pairs64_w4": (64, {"num_warps": 4, "num_stages": 1}, 64),
    "pairs32_w8": (32, {"num_warps": 8, "num_stages": 1}, 64),
    "chunk32": (32, {"num_warps": 4, "num_stages": 1}, 32),
    "chunk32_pairs64_w4": (64, {"num_warps": 4, "num_stages": 1}, 32),
    "pairs16_w4": (16, {"num_warps": 4, "num_stages": 1}, 64),  # last: narrow tiles have faulted
}


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main() -> None:
    out = Path(sys.argv[1])
    dev = torch.device("cuda")
    base = copy.deepcopy(M.TUNING)
    rows, metrics = [], {}
    for cname, case in CASES.items():
        gen = torch.Generator(device=dev).manual_seed(0)
        inp = _mamba3_inputs(case, torch.bfloat16, dev, gen)
        cot = torch.randn(inp["v"].shape, device=dev, dtype=torch.bfloat16, generator=gen)

        def fwd_bwd(inp=inp, cot=cot):
            y, _ = M.mamba3_scan_triton(**inp)
            return (y, *torch.autograd.grad(y, [inp[n] for n in GRADS], cot))

        ref = None
        for sname, (pairs, launch, chunk) in SETTINGS.items():
            M.TUNING.clear()
            M.TUNING.update(copy.deepcopy(base))
            M.TUNING["dqk_pairs"] = pairs
            M.TUNING["launch"]["bwd_dqk"] = launch
            M.TUNING["max_chunk"] = chunk
            try:
                got = fwd_bwd()
            except Exception as exc:  # noqa: BLE001 (a setting that does not compile is a result)
                row = {"case": cname, "setting": sname, "error": f"{type(exc).__name__}: {exc}"[:300]}
                rows.append(row)
                print(json.dumps(row), flush=True)
                continue
            if ref is None:
                ref = got
            err = max(rel(a, b) for a, b in zip(got, ref))
            for _ in range(3):
                fwd_bwd()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    fwd_bwd()
                torch.cuda.synchronize()
            us: dict[str, float] = {}
            for e in prof.key_averages():
                if e.device_type.name == "CUDA" and e.key.startswith("_"):
                    us[e.key[:24]] = us.get(e.key[:24], 0.0) + e.device_time_total / 10
            runs = []
            for _ in range(5):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(10):
                    fwd_bwd()
                b.record()
                torch.cuda.synchronize()
                runs.append(a.elapsed_time(b) / 10)
            ms = statistics.median(runs)
            row = {"case": cname, "setting": sname, "ms": round(ms, 4),
                   "kernels_us": {k: round(v, 1) for k, v in us.items()},
                   "max_rel_err_vs_shipped": err}
            rows.append(row)
            metrics[f"{cname}/{sname}/ms"] = ms
            metrics[f"{cname}/{sname}/bwd_dqk_us"] = us.get("_bwd_dqk", 0.0)
            print(json.dumps(row), flush=True)
        M.TUNING.clear()
        M.TUNING.update(copy.deepcopy(base))
        del inp, ref
        torch.cuda.empty_cache()
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    write_receipt(out.with_suffix(".receipt.json"), "bench",
                  {"script": "benchmarks/results/kernels/h100_s24/mamba3_dqk_sweep.py",
                   "dtype": "bfloat16", "cases": CASES,
                   "settings": {k: list(v) for k, v in SETTINGS.items()}}, metrics, [out])


if __name__ == "__main__":
    main()
