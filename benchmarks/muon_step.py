"""The optimizer step of ``megacpp train`` (AdamW + Muon) on a model's parameters, with Muon's
elementwise passes on each backend of the catalog's ``muon_momentum`` / ``muon_apply`` rows:
the foreach reference and the fused Triton passes, in one process on one GPU.

    PYTHONPATH=src python benchmarks/muon_step.py --preset nam56r-350m

Per backend: ms of one whole step per call (CUDA events around ``Optimizers.step()``, as an
eager run issues it) and replayed from a CUDA graph (as ``parallel.cuda_graph`` runs it), the
median of ``--iters``; the ms of the step's kernels by family (profiler, one replay), and the
parameters after ``--iters`` steps from the same start compared between the backends (largest
relative difference: rounding only). Random gradients, fp32 parameters, Newton-Schulz in bf16
as the trainer runs it on a GPU. Writes ``muon_step.json``, its receipt under
``receipts/muon_step/`` and ``command.txt`` to ``--out`` (default
``benchmarks/results/muon_step/<device>``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from megacpp.contract import capture_fingerprint
from megacpp.kernels.profiling import kernel_family, kernel_times_us
from megacpp.kernels.runtime import chosen_kernels, clear_resolutions, kernel_mode_override
from megacpp.kernels.timing import capture_graph, cuda_times_ms
from megacpp.model.config import load_config
from megacpp.model.model import HybridLM
from megacpp.receipts import write_receipt
from megacpp.receipts.results import begin, results_dir
from megacpp.train.config import OptimSection
from megacpp.train.optim import Optimizers

MODES = {"reference": "foreach reference", "fast": "fused Triton passes"}


def _model(preset: str, device: torch.device, seed: int) -> HybridLM:
    torch.manual_seed(seed)
    model = HybridLM(load_config(preset)).to(device)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen, device=device) * 1e-3
    return model


def run(preset: str, mode: str, iters: int, device: torch.device) -> dict:
    model = _model(preset, device, seed=0)
    with kernel_mode_override(mode):
        clear_resolutions()
        opts = Optimizers(model, OptimSection(lr=1e-3), device, capturable=True)
        opts.set_lr(1e-3)
        per_call = cuda_times_ms(opts.step, warmup=3, iters=iters)
        with opts.device_lr(device):
            graph, _ = capture_graph(opts.step, warmup=2)
        replay = cuda_times_ms(graph.replay, warmup=3, iters=iters)
        kernels = kernel_times_us(graph.replay)
        chosen = chosen_kernels()
    # the numerics: a fresh model, the same steps on this backend
    fresh = _model(preset, device, seed=0)
    with kernel_mode_override(mode):
        clear_resolutions()
        fresh_opts = Optimizers(fresh, OptimSection(lr=1e-3), device, capturable=True)
        for _ in range(5):
            fresh_opts.set_lr(1e-3)
            fresh_opts.step()
    torch.cuda.synchronize()
    families: dict[str, float] = {}
    for name, us in kernels.items():  # the profile's families (ours by Triton module)
        key = kernel_family(name)
        families[key] = families.get(key, 0.0) + us / 1000
    return {"mode": mode, "what": MODES[mode], "per_call_ms": statistics.median(per_call),
            "replay_ms": statistics.median(replay), "families_ms": families,
            "top_kernels_us": dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:12]),
            "kernels": chosen, "params": [p.detach().clone() for p in fresh.parameters()]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="nam56r-350m")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None,
                    help="results folder (default: benchmarks/results/muon_step/<device>)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: benchmarks/muon_step.py needs a CUDA device")
    device = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name()}", flush=True)
    out = begin(args.out or results_dir("muon_step"), "muon_step", "muon_step")
    results = [run(args.preset, mode, args.iters, device) for mode in MODES]
    ref, fused = results
    worst = max(float(((a - b).norm() / b.norm().clamp_min(1e-30)).item())
                for a, b in zip(fused.pop("params"), ref.pop("params"), strict=True))
    for r in results:
        print(f"{r['what']:>22}: per call {r['per_call_ms']:.2f} ms, replay {r['replay_ms']:.2f} "
              f"ms; " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["families_ms"].items())))
    speedup = {"per_call": ref["per_call_ms"] / fused["per_call_ms"],
               "replay": ref["replay_ms"] / fused["replay_ms"]}
    print(f"fused vs reference: {speedup['per_call']:.2f}x per call, {speedup['replay']:.2f}x "
          f"replayed; parameters after 5 steps: largest relative difference {worst:.2e}")
    doc = {"preset": args.preset, "device": torch.cuda.get_device_name(), "results": results,
           "speedup": speedup, "max_rel_param_diff_5_steps": worst}
    (out / "muon_step.json").write_text(json.dumps(doc, indent=2))
    metrics = {f"{r['mode']}_{k}": float(r[k]) for r in results
               for k in ("per_call_ms", "replay_ms")}
    metrics.update({"speedup_per_call": speedup["per_call"], "speedup_replay": speedup["replay"],
                    "max_rel_param_diff_5_steps": worst})
    write_receipt(out / "receipts" / "muon_step" / "muon_step.receipt.json", "bench",
                  {"preset": args.preset, "iters": args.iters, "optimizer": "AdamW + Muon",
                   "ns_dtype": "bfloat16"}, metrics, [out / "muon_step.json"],
                  kernels=fused["kernels"], fingerprint=capture_fingerprint())
    print(f"results: {out / 'muon_step.json'}")


if __name__ == "__main__":
    main()
