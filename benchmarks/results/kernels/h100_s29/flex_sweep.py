"""Session 29 probe: FlexAttention launch settings for the document attention of packed rows.

The chosen ``flex`` row replays its forward+backward in ~1.07 ms a layer at the nam56r step's
shape (B 8, H 12 / 2, L 2048, Dh 64, 2 documents a row), against 0.61 ms for the causal flash
kernel with no documents (call 3 of this session), though it computes about half the tiles.
This times the forward alone and forward+backward as CUDA-graph replays for Inductor's default
H100 setting (forward 128 x 128 tiles, 3 stages, 4 warps; backward 64 / 128 / 128 / 64, 3
stages, 8 warps) and others given as ``kernel_options`` (``fwd_`` / ``bwd_`` prefixed), and
checks each output against the default's.

usage: python3 flex_sweep.py OUT_JSON [--docs 2] [--round 1|2|3]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import flex_attention

from megacpp.kernels.ops.attention.document import document_block_mask
from megacpp.kernels.registry import _document_attention_inputs
from megacpp.kernels.timing import capture_graph, cuda_times_ms, time_fwd_bwd_graphed

FWD = {  # BLOCK_M, BLOCK_N, num_stages, num_warps
    "f128x128s3w4 (default)": (128, 128, 3, 4),
    "f128x64s3w4": (128, 64, 3, 4),
    "f128x128s2w8": (128, 128, 2, 8),
    "f64x128s3w4": (64, 128, 3, 4),
    "f128x64s4w4": (128, 64, 4, 4),
    "f64x64s3w4": (64, 64, 3, 4),
}
# BLOCK_M1, BLOCK_N1, BLOCK_N2, BLOCK_M2, num_stages, num_warps. Note: Inductor's own tuple is
# (M1, N1, M2, N2), so its default is M1 64, N1 128, M2 128, N2 64; the entries below with
# N2 > M2 fail the backward template's static assertion (BLOCK_M2 % BLOCK_N2 == 0): those are
# the "CompileTimeAssertionFailure" rows of rounds 1-2. Round 3 names M1, N1, M2, N2 in order.
BWD = {
    "b64_128_128_64s3w8 (default)": (64, 128, 128, 64, 3, 8),
    "b64_128_128_64s3w4": (64, 128, 128, 64, 3, 4),
    "b64_64_64_64s3w4": (64, 64, 64, 64, 3, 4),
    "b32_64_64_32s3w4": (32, 64, 64, 32, 3, 4),
    "b32_128_128_32s3w4": (32, 128, 128, 32, 3, 4),
    "b64_128_128_64s2w8": (64, 128, 128, 64, 2, 8),
    "b64_64_64_64s4w4": (64, 64, 64, 64, 4, 4),
    "b32_128_128_32s3w8": (32, 128, 128, 32, 3, 8),
}


# round 2 (call 5): combinations around round 1's best (forward 64-row tiles, backward 64 x 64)
ROUND2 = {
    "f64x64s3w4 + b64_64_64_64s3w4": ((64, 64, 3, 4), (64, 64, 64, 64, 3, 4)),
    "f64x128s3w4 + b64_64_64_64s3w4": ((64, 128, 3, 4), (64, 64, 64, 64, 3, 4)),
    "f64x64s2w4 + b64_64_64_64s3w4": ((64, 64, 2, 4), (64, 64, 64, 64, 3, 4)),
    "f64x64s4w4 + b64_64_64_64s3w4": ((64, 64, 4, 4), (64, 64, 64, 64, 3, 4)),
    "f64x32s3w4 + b64_64_64_64s3w4": ((64, 32, 3, 4), (64, 64, 64, 64, 3, 4)),
    "f32x64s3w4 + b64_64_64_64s3w4": ((32, 64, 3, 4), (64, 64, 64, 64, 3, 4)),
    "f64x64s3w4 + b64_64_64_64s2w4": ((64, 64, 3, 4), (64, 64, 64, 64, 2, 4)),
    "f64x64s3w4 + b64_64_64_64s1w4": ((64, 64, 3, 4), (64, 64, 64, 64, 1, 4)),
    "f64x64s3w4 + b64_64_64_64s3w8": ((64, 64, 3, 4), (64, 64, 64, 64, 3, 8)),
    "f64x64s3w4 + b32_32_32_32s3w4": ((64, 64, 3, 4), (32, 32, 32, 32, 3, 4)),
    "f64x64s3w4 + b32_64_64_32s2w4": ((64, 64, 3, 4), (32, 64, 64, 32, 2, 4)),
    "f64x64s3w4 + b64_64_64_64s5w4": ((64, 64, 3, 4), (64, 64, 64, 64, 5, 4)),
}


# round 3 (call 6): forward 64 x 128, 3 stages, 4 warps; backward (M1, N1, M2, N2, stages,
# warps), the settings rounds 1-2 meant to try but named wrongly
ROUND3 = {
    "b64_64_64_64s3w4 (round 2's pick)": (64, 64, 64, 64, 3, 4),
    "b64_128_128_64s3w8 (Inductor's)": (64, 128, 128, 64, 3, 8),
    "b64_128_128_64s3w4": (64, 128, 128, 64, 3, 4),
    "b64_128_128_64s2w4": (64, 128, 128, 64, 2, 4),
    "b64_128_128_64s2w8": (64, 128, 128, 64, 2, 8),
    "b32_64_64_32s3w4": (32, 64, 64, 32, 3, 4),
    "b32_64_64_32s2w4": (32, 64, 64, 32, 2, 4),
    "b32_128_128_32s3w4": (32, 128, 128, 32, 3, 4),
    "b64_64_64_64s2w4": (64, 64, 64, 64, 2, 4),
}


def round3_options(bwd) -> dict:
    return {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 128, "fwd_num_stages": 3, "fwd_num_warps": 4,
            "bwd_BLOCK_M1": bwd[0], "bwd_BLOCK_N1": bwd[1], "bwd_BLOCK_M2": bwd[2],
            "bwd_BLOCK_N2": bwd[3], "bwd_num_stages": bwd[4], "bwd_num_warps": bwd[5]}


def options(fwd, bwd) -> dict:
    o = {}
    if fwd is not None:
        o.update(fwd_BLOCK_M=fwd[0], fwd_BLOCK_N=fwd[1], fwd_num_stages=fwd[2],
                 fwd_num_warps=fwd[3])
    if bwd is not None:
        o.update(bwd_BLOCK_M1=bwd[0], bwd_BLOCK_N1=bwd[1], bwd_BLOCK_N2=bwd[2],
                 bwd_BLOCK_M2=bwd[3], bwd_num_stages=bwd[4], bwd_num_warps=bwd[5])
    return o


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--docs", type=int, default=2)
    ap.add_argument("--round", type=int, default=1, choices=(1, 2, 3))
    args = ap.parse_args()
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)
    device = torch.device("cuda")
    case = {"batch": 8, "heads": 12, "kv_heads": 2, "seq": 2048, "head_dim": 64,
            "docs": args.docs}
    gen = torch.Generator(device=device).manual_seed(0)
    inp = _document_attention_inputs(case, torch.bfloat16, device, gen)
    for t in ("q", "k", "v"):
        inp[t].requires_grad_(True)
    compiled = torch.compile(flex_attention, dynamic=False)
    mask = document_block_mask(inp["doc_ids"])

    def make(opts):
        def fn(q, k, v, doc_ids):
            return compiled(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=opts or None)
        return fn

    base = make({})
    want = base(**inp).detach().float()
    rows = []
    variants = [("default", {})]
    if args.round == 1:
        variants += [(f, options(FWD[f], None)) for f in list(FWD)[1:]]
        variants += [(b, options(None, BWD[b])) for b in list(BWD)[1:]]
        variants += [("f128x128s3w4 + USE_TMA", {"USE_TMA": True})]
    elif args.round == 2:
        variants += [(n, options(*fb)) for n, fb in ROUND2.items()]
    else:
        variants += [(n, round3_options(b)) for n, b in ROUND3.items()]
    for name, opts in variants:
        fn = make(opts)
        try:
            got = fn(**inp).detach().float()
            err = float((got - want).abs().max() / want.abs().max())
            graph, _ = capture_graph(lambda fn=fn: fn(**inp), warmup=2)
            fwd = statistics.median(cuda_times_ms(graph.replay, iters=20))
            both = time_fwd_bwd_graphed(fn, inp, ("q", "k", "v"), device, repeats=20)
            rows.append({"variant": name, "kernel_options": opts, "fwd_replay_ms": fwd,
                         "fwd_bwd_replay_ms": both.median_ms, "failure": both.failure,
                         "max_rel_err_vs_default": err})
            print(f"{name:32s} fwd {fwd:6.3f} ms  fwd+bwd {both.median_ms or float('nan'):6.3f} ms"
                  f"  err {err:.1e}", flush=True)
        except Exception as exc:  # noqa: BLE001 -- a setting Inductor refuses: say so, go on
            rows.append({"variant": name, "kernel_options": opts,
                         "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            print(f"{name:32s} error {rows[-1]['error'][:200]}", flush=True)
        args.out.write_text(json.dumps({"torch": torch.__version__, "case": case, "rows": rows},
                                       indent=1))


if __name__ == "__main__":
    main()
