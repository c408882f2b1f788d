"""The side stream (megacpp.kernels.streams) in the MoE and Mamba-3 backward passes, on and off,
in one process: the MoE at the bench's e64_k8 / e16_k2 and the nam56r-350m step's shape (16384
tokens, d 768, 16 experts top-2, ffn 272), Mamba-3 at the bench's (B 8, L 4096, 32 heads of
d_state 128) and the step's (B 8, L 2048, 24 heads of d_state 64, resets). Modes, in turn for
ROUNDS rounds: "off" (MEGACPP_SIDE_STREAM=0: every kernel in order on one stream), "on" (the
side stream at the default priority) and "on_hi" (the side stream at priority -1, ahead of
the current stream's blocks). Each mode's fwd+bwd is captured as a CUDA graph and timed by
replays (median of 20, each alone between events), and per call (median of 10, host launch
gaps included); the graph's gradients are compared bit for bit with the first "off" ones.
Writes OUT.json (rows) and a bench receipt.

    PYTHONPATH=src python benchmarks/results/kernels/h100_s25/side_stream_probe.py OUT.json
"""

import json
import os
import statistics
import sys
from pathlib import Path

import torch

from megacpp.kernels import streams, timing
from megacpp.kernels.ops.mamba3_scan.triton import mamba3_scan_triton
from megacpp.kernels.ops.moe.grouped import moe_experts_grouped
from megacpp.kernels.registry import _mamba3_inputs, _moe_inputs
from megacpp.receipts import write_receipt

CASES = {
    "moe_e64_k8": {"tokens": 16384, "dim": 1024, "experts": 64, "top_k": 8, "ffn": 512},
    "moe_e16_k2": {"tokens": 16384, "dim": 1024, "experts": 16, "top_k": 2, "ffn": 2048},
    "moe_step": {"tokens": 16384, "dim": 768, "experts": 16, "top_k": 2, "ffn": 272},
    "mamba3_seq4096": {"batch": 8, "seq": 4096, "groups": 1, "heads": 32, "d_state": 128,
                       "headdim": 64, "angles": 32, "chunk": 64, "final_state": 0},
    "mamba3_step": {"batch": 8, "seq": 2048, "groups": 1, "heads": 24, "d_state": 64,
                    "headdim": 64, "angles": 16, "chunk": 64, "resets": 1, "final_state": 0},
}
MODES = {"off": ("0", 0), "on": ("1", 0), "on_hi": ("1", -1)}
ROUNDS = 3
MOE_GRADS = ("x", "weights", "w_in", "w_out")
MAMBA_GRADS = ("q", "k", "v", "adt", "dt", "trap", "q_bias", "k_bias", "angles", "D", "z")


def moe(x, expert_idx, weights, w_in, w_out):
    return moe_experts_grouped(x, expert_idx, weights, w_in, w_out)


def mamba3(**kw):
    return mamba3_scan_triton(**kw)[0]


def main() -> None:
    out = Path(sys.argv[1])
    dev = torch.device("cuda")
    rows, metrics = [], {}
    for case, shape in CASES.items():
        gen = torch.Generator(device=dev).manual_seed(0)
        if case.startswith("moe"):
            fn, grads, inp = moe, MOE_GRADS, _moe_inputs(shape, torch.bfloat16, dev, gen)
        else:
            fn, grads, inp = mamba3, MAMBA_GRADS, _mamba3_inputs(shape, torch.bfloat16, dev, gen)
        ref = None
        for rnd in range(ROUNDS):
            for mode, (env, priority) in MODES.items():
                os.environ[streams.ENV] = env
                streams.PRIORITY = priority
                per_call = timing.time_fwd_bwd(fn, inp, grads, dev, warmup=3, repeats=10)
                captured = timing.capture_fwd_bwd(fn, inp, grads, dev)
                replay = statistics.median(timing.cuda_times_ms(captured.graph.replay, 3, 20))
                got = [g.clone() for g in captured.grads if g is not None]
                ref = ref if ref is not None else got
                same = all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
                row = {"case": case, "round": rnd, "mode": mode, "replay_ms": round(replay, 4),
                       "per_call_ms": round(per_call.median_ms, 4),
                       "peak_gib": round(per_call.peak_extra_bytes / 2**30, 3),
                       "bitwise_same_as_off": same}
                rows.append(row)
                metrics[f"{case}/{mode}/r{rnd}/replay_ms"] = replay
                metrics[f"{case}/{mode}/r{rnd}/per_call_ms"] = per_call.median_ms
                print(json.dumps(row), flush=True)
                del captured, got
                torch.cuda.empty_cache()
        del inp, ref
        torch.cuda.empty_cache()
    os.environ.pop(streams.ENV, None)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    write_receipt(out.with_suffix(".receipt.json"), "bench",
                  {"script": "benchmarks/results/kernels/h100_s25/side_stream_probe.py",
                   "dtype": "bfloat16", "cases": CASES, "modes": MODES, "rounds": ROUNDS},
                  metrics, [out])


if __name__ == "__main__":
    main()
