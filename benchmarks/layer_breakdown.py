"""Where a training step's time goes, per block kind: each distinct block of the hybrid (one
per letter of its pattern: A, E, M, R, ...) and the head (final norm + loss) timed forward +
backward on its own, eager or regionally compiled, with the kernels of one kernel mode.

    PYTHONPATH=src python benchmarks/layer_breakdown.py --preset nam56r-350m --seq-len 2048 \
        --kernels fast --modes eager compiled --out DIR [--profile]

Per kind: median fwd+bwd ms of one block (CUDA events around one call, as the training step
times itself), blocks of that kind in the model, their total ms per step, the share of the
summed step, the forward matmul FLOPs the analytic counter gives the kind (x3 for fwd+bwd)
and the TFLOP/s that implies. With ``--profile``: the top CUDA kernels of each kind. The
input is the residual stream in float32 (fp32 parameters, bf16 autocast), as in
``benchmarks/train_step.py``; the optimizer step is not included. Writes DIR/layer_breakdown.json
and a receipt.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from megacpp.contract import capture_fingerprint
from megacpp.kernels.profiling import device_rows
from megacpp.kernels.runtime import chosen_kernels, clear_resolutions, set_kernel_mode
from megacpp.kernels.timing import cuda_times_ms, matmul_peak_tflops
from megacpp.model.config import load_config
from megacpp.model.counting import count_model
from megacpp.model.model import HybridLM, next_token_labels
from megacpp.receipts import write_receipt


def _fwd_bwd(fn, x: torch.Tensor, cot: torch.Tensor | None):
    def step():
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            out = fn(x)
        if cot is None:
            out.backward()
        else:
            out.backward(cot)

    return step


def _median_ms(step, warmup: int) -> float:
    """Median ms of ``step`` (CUDA events on a GPU; the host clock on the CPU smoke path)."""
    if torch.cuda.is_available():
        return statistics.median(cuda_times_ms(step, warmup=warmup, iters=10))
    for _ in range(warmup):
        step()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _top_kernels(step, n: int = 8) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    rows = device_rows(prof.key_averages())
    rows.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in rows) or 1.0
    return [{"kernel": e.key[:100], "ms_per_call": e.self_device_time_total / 3e3,
             "share": e.self_device_time_total / total, "launches_per_call": e.count // 3}
            for e in rows[:n]]


def _row(kind: str, blocks: int, step, warmup: int, train_flops_one: float, mode: str,
         profile: bool) -> dict:
    """Time one block (or the head) fwd+bwd; its row, printed as it is measured."""
    ms = _median_ms(step, warmup=warmup)
    row = {"kind": kind, "blocks": blocks, "ms_one": ms, "ms_total": ms * blocks,
           "train_tflop": train_flops_one * blocks / 1e12,
           "tflops": train_flops_one / (ms * 1e-3) / 1e12}
    if profile and torch.cuda.is_available():
        row["top_kernels"] = _top_kernels(step)
    print(f"  {mode:>8} {kind:>6} x{blocks:<3} {ms:7.2f} ms/block {ms * blocks:8.1f} ms"
          f"  {row['tflops']:6.1f} TFLOP/s", flush=True)
    return row


def breakdown(preset: str, seq_len: int, batch: int, mode: str, profile: bool) -> dict:
    cfg = load_config(preset)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = HybridLM(cfg).to(device)
    cost = count_model(cfg, seq_len=seq_len)
    kinds: dict[str, list[int]] = {}
    for i, block in enumerate(model.blocks):
        kinds.setdefault(block.letter, []).append(i)
    x = torch.randn(batch, seq_len, cfg.d_model, device=device, requires_grad=True)
    cot = torch.randn_like(x)
    rows = []
    for letter, idx in kinds.items():
        block = model.blocks[idx[0]]
        fn = torch.compile(block) if mode == "compiled" else block
        fwd_flops = cost.layers[idx[0]].fwd_flops_per_token * batch * seq_len
        rows.append(_row(letter, len(idx), _fwd_bwd(fn, x, cot), 3 if mode == "eager" else 5,
                         3 * fwd_flops, mode, profile))
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len), device=device)
    labels = next_token_labels(ids)

    def head(h):  # as HybridLM.forward computes the loss from the residual stream
        return model.lm_loss(model.norm(h), labels)[0]

    rows.append(_row("head", 1, _fwd_bwd(head, x, None), 3,
                     3 * cost.head_flops_per_token * batch * seq_len, mode, profile))
    total = sum(r["ms_total"] for r in rows)
    for r in rows:
        r["share"] = r["ms_total"] / total
    return {"mode": mode, "seq_len": seq_len, "batch": batch, "sum_ms": total, "rows": rows,
            "kernels": chosen_kernels()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="nam56r-350m")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per call (batch x seq)")
    ap.add_argument("--kernels", default="fast", choices=["reference", "auto", "fast"])
    ap.add_argument("--modes", nargs="+", default=["eager"], choices=["eager", "compiled"])
    ap.add_argument("--profile", action="store_true", help="top CUDA kernels of each kind (GPU)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    set_kernel_mode(args.kernels)
    clear_resolutions()
    if torch.cuda.is_available():
        peak = matmul_peak_tflops()
        print(f"device: {torch.cuda.get_device_name()}  bf16 matmul peak {peak:.0f} TFLOP/s",
              flush=True)
    else:  # a smoke run of the script itself; its numbers mean nothing
        peak = None
        print("no CUDA: CPU smoke run (numbers are not a measurement)", flush=True)
    batch = max(1, args.tokens // args.seq_len)
    results = [breakdown(args.preset, args.seq_len, batch, m, args.profile) for m in args.modes]
    for r in results:
        print(f"{r['mode']}: sum of parts {r['sum_ms']:.1f} ms; "
              + ", ".join(f"{x['kind']} {100 * x['share']:.0f}%" for x in r["rows"]))
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"preset": args.preset, "kernels": args.kernels, "matmul_peak_tflops": peak,
           "results": results}
    (args.out / "layer_breakdown.json").write_text(json.dumps(doc, indent=2))
    config = {"preset": args.preset, "seq_len": args.seq_len, "batch": batch,
              "kernel_mode": args.kernels, "modes": args.modes, "dtype": "bf16-autocast"}
    metrics = {f"{r['mode']}_{x['kind']}_ms": float(x["ms_total"])
               for r in results for x in r["rows"]}
    if peak is not None:  # None on the CPU smoke run
        metrics["matmul_peak_tflops"] = peak
    write_receipt(args.out / "layer_breakdown.receipt.json", "bench", config, metrics,
                  [args.out / "layer_breakdown.json"], kernels=results[0]["kernels"],
                  fingerprint=capture_fingerprint())
    print(f"results: {args.out / 'layer_breakdown.json'}")


if __name__ == "__main__":
    main()
