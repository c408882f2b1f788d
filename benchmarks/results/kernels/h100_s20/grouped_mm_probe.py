"""The MoE expert GEMMs (ragged M): torch._grouped_mm (CUTLASS) against the Triton kernel
``moe.triton.grouped_mm_triton`` in several launch settings, at the nam56r step's four shapes
(16 experts top-2, 16384 tokens, d 768, ffn 272: gate|up, down, and their input gradients) and
the kernel bench's e64_k8 / e16_k2 (d 1024). Random routing (top-k of Gaussian logits). Time:
50 calls back to back between two CUDA events, the median of 5 such runs; results checked
against torch._grouped_mm (max |diff| / max |ref|). Session 20.

    PYTHONPATH=$PWD/src python benchmarks/results/kernels/h100_s20/grouped_mm_probe.py OUT.json
        [CASE,... [CONFIGS_JSON]]
Run 1 (call 4): every case, CONFIGS. Run 2 (call 5): "step" with K blocks of 32 and 16
(RUN2_CONFIGS; K 272 = 17 x 16 and 544 = 17 x 32 are whole blocks there).
"""

import json
import statistics
import sys

import torch

from megacpp.kernels.ops.moe import triton as K
from megacpp.kernels.ops.moe.grouped import dispatch_plan

CONFIGS = [
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
    {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4},
    {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4},
    {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4},
    {"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4},
]
RUN2_CONFIGS = [
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 8, "num_stages": 5},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 4, "num_stages": 5},
    {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 32, "num_warps": 8, "num_stages": 5},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 16, "num_warps": 4, "num_stages": 6},
    {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 16, "num_warps": 8, "num_stages": 6},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
]
CASES = {  # name: (tokens, d, experts, top_k, ffn)
    "step": (16384, 768, 16, 2, 272), "e64_k8": (16384, 1024, 64, 8, 512),
    "e16_k2": (16384, 1024, 16, 2, 2048),
}


def timed_ms(fn) -> float:
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
        runs.append(begin.elapsed_time(end) / 50)
    return statistics.median(runs)


def main() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows_out = []
    cases = sys.argv[2].split(",") if len(sys.argv) > 2 else list(CASES)
    configs = {"run2": RUN2_CONFIGS}.get(sys.argv[3], CONFIGS) if len(sys.argv) > 3 else CONFIGS
    for case in cases:
        tokens, d, experts, top_k, ffn = CASES[case]
        logits = torch.randn(tokens, experts, device=dev, generator=gen)
        idx = logits.topk(top_k, dim=-1).indices
        offs = dispatch_plan(idx, experts).offs
        rows = tokens * top_k
        w_in = torch.randn(experts, 2 * ffn, d, device=dev, generator=gen).bfloat16() * 0.05
        w_out = torch.randn(experts, d, ffn, device=dev, generator=gen).bfloat16() * 0.05

        def act(cols, rows=rows):
            return torch.randn(rows, cols, device=dev, generator=gen).bfloat16()

        gemms = {  # name: (a, w, trans_b)
            "gate_up": (act(d), w_in, True), "down": (act(ffn), w_out, True),
            "d_hidden": (act(d), w_out, False), "dx": (act(2 * ffn), w_in, False),
        }
        for name, (a, w, trans) in gemms.items():
            n = w.shape[1] if trans else w.shape[2]
            flops = 2 * rows * a.shape[1] * n
            b = w.transpose(-2, -1) if trans else w
            ref = torch._grouped_mm(a, b, offs=offs)
            row = {"case": case, "gemm": name, "rows": rows, "N": n, "K": a.shape[1],
                   "torch_us": 1e3 * timed_ms(lambda a=a, b=b, offs=offs: torch._grouped_mm(a, b, offs=offs))}
            dense_a, dense_b = a, torch.randn(a.shape[1], n, device=dev).bfloat16()
            row["dense_us"] = 1e3 * timed_ms(lambda a=dense_a, b=dense_b: a @ b)
            row["ours"] = []
            for cfg in configs:
                # (calls 4 and 5 ran an earlier draft whose table had one default entry)
                K.GROUPED_CONFIGS[(n, a.shape[1])] = cfg
                try:
                    got = K.grouped_mm_triton(a, w, offs, trans)
                    err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
                    us = 1e3 * timed_ms(
                        lambda a=a, w=w, offs=offs, trans=trans: K.grouped_mm_triton(a, w, offs, trans))
                except Exception as exc:  # noqa: BLE001 -- a setting that fails is a result
                    row["ours"].append({"cfg": cfg, "error": str(exc)[:200]})
                    continue
                row["ours"].append({"cfg": cfg, "us": us, "err": err})
            best = min((o for o in row["ours"] if "us" in o), key=lambda o: o["us"])
            print(f"{case:7s} {name:9s} N {n:5d} K {a.shape[1]:5d}  torch {row['torch_us']:7.1f} us "
                  f"({flops / row['torch_us'] / 1e6:5.0f} TFLOP/s)  dense {row['dense_us']:6.1f}  "
                  f"ours best {best['us']:7.1f} ({flops / best['us'] / 1e6:5.0f}) err {best['err']:.1e} "
                  f"{[round(o.get('us', -1), 1) for o in row['ours']]}", flush=True)
            rows_out.append(row)
            with open(sys.argv[1], "w") as f:
                json.dump({"configs": configs, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
