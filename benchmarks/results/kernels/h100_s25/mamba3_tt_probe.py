"""TUNING["tt_in_dx"] (the chunk's [T, T] work of d(q, k) in _bwd_dx: d_qk stored for
_bwd_dqk's pair tiles, the intra part of the scalar grads as a share of _bwd_dx's own) against
the shipped split (every _bwd_dqk pair tile forms d_qk and its part of those grads), with
launch settings that its offline compile suggested (tt_compile.py: _bwd_dx spills 200-216
bytes at 4 warps, none at 8; _bwd_dqk spills none either way), at the bench's shape (B 8,
L 4096, 32 heads of d_state 128) and the nam56r-350m step's (B 8, L 2048, 24 heads of d_state
64, resets), all in one process. Per setting: each kernel's CUDA time (profiler, 10 fwd+bwd),
the fwd+bwd's CUDA-graph replay time (median of 20) and the largest relative error of y and
every gradient against the shipped setting's (one fixed cotangent). Writes OUT.json and a
bench receipt.

    PYTHONPATH=src python benchmarks/results/kernels/h100_s25/mamba3_tt_probe.py OUT.json
"""

import copy
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
GRADS = ("q", "k", "v", "adt", "dt", "trap", "q_bias", "k_bias", "angles", "D", "z")
SETTINGS = {  # name -> (tt_in_dx, bwd_dx warps, dqk_pairs, bwd_dqk warps)
    "shipped": (False, 4, 32, 4),
    "tt": (True, 4, 32, 4),
    "tt_dx8": (True, 8, 32, 4),
    "tt_dx8_dqk8": (True, 8, 32, 8),
    "tt_dx8_dqk64w8": (True, 8, 64, 8),
    "tt_dqk64w8": (True, 4, 64, 8),
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
        for sname, (tt, dx_warps, pairs, dqk_warps) in SETTINGS.items():
            M.TUNING.clear()
            M.TUNING.update(copy.deepcopy(base))
            M.TUNING["tt_in_dx"] = tt
            M.TUNING["launch"]["bwd_dx"] = {"num_warps": dx_warps, "num_stages": 1}
            M.TUNING["dqk_pairs"] = pairs
            M.TUNING["launch"]["bwd_dqk"] = {"num_warps": dqk_warps, "num_stages": 1}
            try:
                got = [t.detach().clone() for t in fwd_bwd()]  # (no graph kept alive)
            except Exception as exc:  # noqa: BLE001 (a setting that does not compile is a result)
                row = {"case": cname, "setting": sname, "error": f"{type(exc).__name__}: {exc}"[:300]}
                rows.append(row)
                print(json.dumps(row), flush=True)
                continue
            ref = ref if ref is not None else got
            errs = {n: rel(a, b) for n, a, b in zip(("y", *GRADS), got, ref)}
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
            captured = timing.capture_fwd_bwd(lambda **kw: M.mamba3_scan_triton(**kw)[0], inp,
                                              GRADS, dev)
            replay = statistics.median(timing.cuda_times_ms(captured.graph.replay, 3, 20))
            del captured
            row = {"case": cname, "setting": sname, "replay_ms": round(replay, 4),
                   "kernels_us_total": round(sum(us.values()), 1),
                   "kernels_us": {k: round(v, 1) for k, v in us.items()},
                   "max_rel_err_vs_shipped": max(errs.values()), "rel_err_vs_shipped": errs}
            rows.append(row)
            metrics[f"{cname}/{sname}/replay_ms"] = replay
            metrics[f"{cname}/{sname}/kernels_us"] = sum(us.values())
            print(json.dumps(row), flush=True)
        M.TUNING.clear()
        M.TUNING.update(copy.deepcopy(base))
        del inp, ref
        torch.cuda.empty_cache()
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    write_receipt(out.with_suffix(".receipt.json"), "bench",
                  {"script": "benchmarks/results/kernels/h100_s25/mamba3_tt_probe.py",
                   "dtype": "bfloat16", "cases": CASES,
                   "settings": {k: list(v) for k, v in SETTINGS.items()}}, metrics, [out])


if __name__ == "__main__":
    main()
