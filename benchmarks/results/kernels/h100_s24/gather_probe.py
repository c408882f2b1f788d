"""The MoE permute read in the expert GEMMs' operand loads (SortedRows; GATHER_ROWS on) against
the rows written out by the scatter first (GATHER_ROWS off), in one process: the whole
moe_experts_grouped forward+backward per call and CUDA-graph replayed (timing.py's medians of
10, the two modes alternately, ROUNDS rounds), its peak memory over the inputs, the gradients
compared bit for bit, and each mode's kernels from the profiler (mean of 5 calls).
Cases: the kernel bench's e64_k8 and e16_k2, and the nam56r-350m step's MoE (16384 tokens,
d 768, 16 experts top-2, expert ffn 272). Writes OUT.json and a bench receipt.

    PYTHONPATH=src python benchmarks/results/kernels/h100_s24/gather_probe.py OUT.json
"""

import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from megacpp.kernels import timing
from megacpp.kernels.ops.moe import triton as K
from megacpp.kernels.ops.moe.grouped import moe_experts_grouped
from megacpp.kernels.registry import _moe_inputs
from megacpp.receipts import write_receipt

CASES = {
    "e64_k8": {"tokens": 16384, "dim": 1024, "experts": 64, "top_k": 8, "ffn": 512},
    "e16_k2": {"tokens": 16384, "dim": 1024, "experts": 16, "top_k": 2, "ffn": 2048},
    "step": {"tokens": 16384, "dim": 768, "experts": 16, "top_k": 2, "ffn": 272},
}
GRADS = ("x", "weights", "w_in", "w_out")
ROUNDS = 3
MODES = {"written": False, "gathered": True}


def fn(x, expert_idx, weights, w_in, w_out):
    return moe_experts_grouped(x, expert_idx, weights, w_in, w_out)


def kernels_us(inp) -> dict[str, float]:
    cot = torch.randn_like(inp["x"])
    leaves = [inp[n] for n in GRADS]
    for _ in range(2):
        torch.autograd.grad(fn(**inp), leaves, cot)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            torch.autograd.grad(fn(**inp), leaves, cot)
        torch.cuda.synchronize()
    us: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA":
            us[e.key[:48]] = us.get(e.key[:48], 0.0) + e.device_time_total / 5
    return us


def main() -> None:
    out = Path(sys.argv[1])
    dev = torch.device("cuda")
    rows, metrics = [], {}
    for name, case in CASES.items():
        gen = torch.Generator(device=dev).manual_seed(0)
        inp = _moe_inputs(case, torch.bfloat16, dev, gen)
        for n in ("x", "w_in", "w_out"):
            inp[n].requires_grad_()
        grads = {}
        for mode, on in MODES.items():
            K.GATHER_ROWS = on
            y = fn(**inp)
            cot = torch.randn(y.shape, device=dev, dtype=y.dtype,
                              generator=torch.Generator(device=dev).manual_seed(1))
            grads[mode] = [y, *torch.autograd.grad(y, [inp[n] for n in GRADS], cot)]
        same = all(torch.equal(a, b) for a, b in zip(grads["written"], grads["gathered"]))
        del grads
        for r in range(ROUNDS):
            for mode, on in MODES.items():
                K.GATHER_ROWS = on
                call = timing.time_fwd_bwd(fn, inp, GRADS, dev)
                replay = timing.time_fwd_bwd_graphed(fn, inp, GRADS, dev)
                row = {"case": name, "mode": mode, "round": r, "per_call_ms": call.median_ms,
                       "replay_ms": replay.median_ms, "peak_gib": call.peak_extra_bytes / 2**30,
                       "bitwise_same": same, "replay_failure": replay.failure}
                rows.append(row)
                print(json.dumps(row), flush=True)
                metrics[f"{name}/{mode}/r{r}/per_call_ms"] = call.median_ms
                if replay.median_ms is not None:
                    metrics[f"{name}/{mode}/r{r}/replay_ms"] = replay.median_ms
                metrics[f"{name}/{mode}/peak_gib"] = call.peak_extra_bytes / 2**30
        for mode, on in MODES.items():
            K.GATHER_ROWS = on
            us = kernels_us(inp)
            rows.append({"case": name, "mode": mode, "kernels_us": us})
            print(name, mode, f"{sum(us.values()):.1f} us",
                  {k: round(v, 1) for k, v in sorted(us.items(), key=lambda kv: -kv[1])},
                  flush=True)
        del inp
        torch.cuda.empty_cache()
    K.GATHER_ROWS = True
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    write_receipt(out.with_suffix(".receipt.json"), "bench",
                  {"script": "benchmarks/results/kernels/h100_s24/gather_probe.py",
                   "dtype": "bfloat16", "cases": CASES}, metrics, [out])


if __name__ == "__main__":
    main()
