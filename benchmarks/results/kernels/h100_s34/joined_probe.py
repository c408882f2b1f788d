"""TUNING["joined"]: every Mamba-3 matmul over pairs of the state dimension as one product
over the interleaved pairs ([*, 2 pairs]) against two products, one per even / odd half, at the
bench's shape (B 8, L 4096, 32 heads of d_state 128) and the nam56r-350m step's (B 8, L 2048,
24 heads of d_state 64, resets), in one process, the two settings taken in turn for three
rounds. Per setting and round: the fwd+bwd's CUDA-graph replay (median of 20) and per call
(median of 20); in the first round each kernel's CUDA time (profiler, 10 fwd+bwd) and the
largest relative difference of y and every gradient from the halves setting's (one fixed
cotangent). Writes OUT.json and a receipt.

    PYTHONPATH=src python benchmarks/results/kernels/h100_s34/joined_probe.py OUT.json
"""

import json
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from megacpp.kernels import timing
from megacpp.kernels.ops.mamba3_scan import triton as M
from megacpp.kernels.registry import _mamba3_inputs
from megacpp.receipts import write_receipt

CASES = {
    "bench": {"batch": 8, "seq": 4096, "groups": 1, "heads": 32, "d_state": 128, "headdim": 64,
              "angles": 32, "chunk": 64, "final_state": 0},
    "step": {"batch": 8, "seq": 2048, "groups": 1, "heads": 24, "d_state": 64, "headdim": 64,
             "angles": 16, "chunk": 64, "resets": 1, "final_state": 0},
}
DEFAULT = M.TUNING["joined"]
GRADS = ("q", "k", "v", "adt", "dt", "trap", "q_bias", "k_bias", "angles", "D", "z")
SETTINGS = {"halves": False, "joined": True}


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main() -> None:
    out = Path(sys.argv[1])
    dev = torch.device("cuda")
    rows, metrics = [], {}
    for cname, case in CASES.items():
        gen = torch.Generator(device=dev).manual_seed(0)
        inp = _mamba3_inputs(case, torch.bfloat16, dev, gen)
        cot = torch.randn(inp["v"].shape, device=dev, dtype=torch.bfloat16, generator=gen)

        def fwd_bwd(inp=inp, cot=cot):
            y, _ = M.mamba3_scan_triton(**inp)
            return (y, *torch.autograd.grad(y, [inp[n] for n in GRADS], cot))

        ref = None
        for rnd in range(3):
            for sname, flag in SETTINGS.items():
                M.TUNING["joined"] = flag
                row = {"case": cname, "setting": sname, "round": rnd}
                if rnd == 0:
                    got = [t.detach().clone() for t in fwd_bwd()]
                    ref = ref if ref is not None else got
                    errs = {n: rel(a, b) for n, a, b in zip(("y", *GRADS), got, ref)}
                    del got
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
                    row.update(kernels_us={k: round(v, 1) for k, v in us.items()},
                               max_rel_diff_vs_halves=max(errs.values()),
                               rel_diff_vs_halves=errs)
                per_call = statistics.median(timing.cuda_times_ms(fwd_bwd, 3, 20))
                captured = timing.capture_fwd_bwd(lambda **kw: M.mamba3_scan_triton(**kw)[0],
                                                  inp, GRADS, dev)
                replay = statistics.median(timing.cuda_times_ms(captured.graph.replay, 3, 20))
                del captured
                row.update(replay_ms=round(replay, 4), per_call_ms=round(per_call, 4))
                metrics[f"{cname}/{sname}/r{rnd}/replay_ms"] = replay
                metrics[f"{cname}/{sname}/r{rnd}/per_call_ms"] = per_call
                rows.append(row)
                print(json.dumps(row), flush=True)
        M.TUNING["joined"] = DEFAULT
        del inp, ref
        torch.cuda.empty_cache()
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    write_receipt(out.with_suffix(".receipt.json"), "bench",
                  {"script": "benchmarks/results/kernels/h100_s34/joined_probe.py",
                   "dtype": "bfloat16", "cases": CASES, "settings": SETTINGS}, metrics, [out])


def compiled_stats() -> None:
    """Registers and spills of every compiled Mamba-3 kernel (joined: its TTGIR has a join)."""
    for name in ("_prep", "_state_fwd", "_out_fwd", "_state_bwd", "_bwd_dx", "_bwd_dqk",
                 "_bwd_dqk_joined", "_bwd_tokens", "_group_sum"):
        for cache in getattr(M, name).device_caches.values():
            for kern in cache[0].values():
                kern._init_handles()
                print(json.dumps({"kernel": name, "joined": "tt.join" in kern.asm["ttgir"],
                                  "n_regs": kern.n_regs, "n_spills": kern.n_spills,
                                  "shared": kern.metadata.shared}), flush=True)


if __name__ == "__main__":
    main()
    compiled_stats()
