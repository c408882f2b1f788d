"""The MoE permute folded into the expert GEMMs' loads (session 22): the expert-sorted operand
read through the plan (sorted row r = src[order[r] // k]) against the row scatter followed by
the kernels' tensor-memory loads, at the nam56r step's shape (16384 tokens, 16 experts top-2,
d 768, ffn 272) and the kernel bench's e64_k8 (d 1024, ffn 512). Per case and launch setting:
the scatter alone, gate|up (x) and d hidden (dout) as grouped_mm_triton, dw_in (x) and dw_out
(dout) as grouped_wgrad_triton; the through-the-plan results are checked against the
materialized ones (max |diff| / max |ref|). Time: 50 calls back to back between two CUDA
events, the median of 5 such runs.

    PYTHONPATH=$PWD/src python benchmarks/results/kernels/h100_s22/moe_gather_probe.py OUT.json
"""

import json
import statistics
import sys
from functools import partial

import torch

from megacpp.kernels.ops.moe import triton as K
from megacpp.kernels.ops.moe.grouped import dispatch_plan

CASES = {"step": (16384, 768, 16, 2, 272), "e64_k8": (16384, 1024, 64, 8, 512)}
MM_CONFIGS = [  # the shipped 4-warp tile first
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4},
    {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
]
WGRAD_CONFIGS = [
    {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
    {"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
]


def timed_us(fn) -> float:
    for _ in range(5):
        fn()
    runs = []
    for _ in range(5):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(50):
            fn()
        end.record()
        torch.cuda.synchronize()
        runs.append(begin.elapsed_time(end) / 50 * 1e3)
    return statistics.median(runs)


def diff(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def main() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows_out = []

    def report(case, what, cfg, us, err=None):
        row = {"case": case, "what": what, "config": cfg, "us": round(us, 2), "err": err}
        rows_out.append(row)
        print(json.dumps(row), flush=True)

    for case, (tokens, d, experts, top_k, ffn) in CASES.items():
        logits = torch.randn(tokens, experts, device=dev, generator=gen)
        idx = logits.topk(top_k, dim=-1).indices
        plan = dispatch_plan(idx, experts)
        rows = tokens * top_k
        x = torch.randn(tokens, d, device=dev, generator=gen).bfloat16()
        dout = torch.randn(tokens, d, device=dev, generator=gen).bfloat16()
        w_in = (torch.randn(experts, 2 * ffn, d, device=dev, generator=gen) * 0.05).bfloat16()
        w_out = (torch.randn(experts, d, ffn, device=dev, generator=gen) * 0.05).bfloat16()
        dgate_up = torch.randn(rows, 2 * ffn, device=dev, generator=gen).bfloat16()
        hidden = torch.randn(rows, ffn, device=dev, generator=gen).bfloat16()
        report(case, "scatter", None, timed_us(partial(K.scatter_rows_triton, x, plan.inv)))
        through = {"order": plan.order, "top_k": top_k}
        x_sorted = K.scatter_rows_triton(x, plan.inv)
        dy_sorted = K.scatter_rows_triton(dout, plan.inv)
        saved_mm, saved_wg = dict(K.GROUPED_CONFIGS), K.WGRAD_CONFIGS
        try:
            for cfg in MM_CONFIGS:
                for name, src, srt, w, trans_b in (("gate_up", x, x_sorted, w_in, True),
                                                   ("d_hidden", dout, dy_sorted, w_out, False)):
                    n = w.shape[1] if trans_b else w.shape[2]
                    K.GROUPED_CONFIGS[(n, d)] = cfg
                    want = K.grouped_mm_triton(srt, w, plan.offs, trans_b)
                    got = K.grouped_mm_triton(src, w, plan.offs, trans_b, **through)
                    report(case, f"{name}/tma", cfg, timed_us(
                        partial(K.grouped_mm_triton, srt, w, plan.offs, trans_b)))
                    report(case, f"{name}/plan", cfg, timed_us(
                        partial(K.grouped_mm_triton, src, w, plan.offs, trans_b, **through)),
                        diff(got, want))
            for cfg in WGRAD_CONFIGS:
                K.WGRAD_CONFIGS = (cfg,)
                for name, a, src, srt, t in (("dw_in", dgate_up, x, x_sorted, False),
                                             ("dw_out", hidden, dout, dy_sorted, True)):
                    want = K.grouped_wgrad_triton(a, srt, plan.offs, torch.float32, t)
                    got = K.grouped_wgrad_triton(a, src, plan.offs, torch.float32, t, **through)
                    report(case, f"{name}/tma", cfg, timed_us(
                        partial(K.grouped_wgrad_triton, a, srt, plan.offs, torch.float32, t)))
                    report(case, f"{name}/plan", cfg, timed_us(partial(
                        K.grouped_wgrad_triton, a, src, plan.offs, torch.float32, t, **through)),
                        diff(got, want))
        finally:
            K.GROUPED_CONFIGS.clear()
            K.GROUPED_CONFIGS.update(saved_mm)
            K.WGRAD_CONFIGS = saved_wg
    with open(sys.argv[1], "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
