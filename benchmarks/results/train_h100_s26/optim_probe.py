"""Device probe: the trainer's graphed optimizer step (AdamW + Muon) of nam56r-350m with three
Newton-Schulz iterations, alternately in one process, AdamW alone beside them:

* "old": session 25's (one tensor op per term of the quintic; the updates stacked in float32,
  then cast);
* "epilogue": the two scale-and-adds as GEMM epilogues, ``baddbmm`` (torch copies C into the
  output first: a device memcpy of X per iteration); updates stacked straight into bfloat16;
* "diagonal": ``X = (a I + b A + c A A) X``, with ``a`` added to the diagonal of the
  ``baddbmm``'d polynomial, so the last product is a plain ``bmm`` (no copy of X); same
  stacking.

Per variant: the whole optimizer step captured as a CUDA graph (median of 20 replays), its
kernels by family (profiler, 5 replays), and per matrix shape the batched Newton-Schulz alone
(graph replay, TFLOP/s of its three GEMMs per iteration). Writes OUT.json and a bench receipt.
The call's first run (call1/) had "old" and "epilogue" (then named "new") only.

    PYTHONPATH=src python benchmarks/results/train_h100_s26/optim_probe.py OUT.json
"""

import json
import statistics
import sys
from pathlib import Path

import torch

from megacpp.kernels import timing
from megacpp.kernels.profiling import family_breakdown, format_breakdown, kernel_times_us
from megacpp.model.config import load_config
from megacpp.model.model import HybridLM
from megacpp.receipts import write_receipt
from megacpp.train.config import OptimSection
from megacpp.train.optim import NS_COEFFS, Muon, Optimizers, _same_shape_batches, group_parameters

NEW_UPDATE_BATCH = Muon._update_batch


def _normalized(update, dtype, eps):
    x = update.to(dtype)
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    return x.reshape(-1, *x.shape[-2:]), transposed


def epilogue_newton_schulz(update, steps=5, dtype=torch.float32, eps=1e-7):
    a, b, c = NS_COEFFS
    shape = update.shape
    x, transposed = _normalized(update, dtype, eps)
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    x = x.mT if transposed else x
    return x.reshape(shape).to(update.dtype)


def diagonal_newton_schulz(update, steps=5, dtype=torch.float32, eps=1e-7):
    a, b, c = NS_COEFFS
    shape = update.shape
    x, transposed = _normalized(update, dtype, eps)
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        poly.diagonal(dim1=-2, dim2=-1).add_(a)
        x = torch.bmm(poly, x)
    x = x.mT if transposed else x
    return x.reshape(shape).to(update.dtype)


def stacked_update_batch(ns):
    """This session's Muon._update_batch, with ``ns`` as its Newton-Schulz."""
    def update_batch(self, params, group):
        updates = self._momentum(params, group)
        rows, cols = params[0].shape[-2:]
        counts = [u.numel() // (rows * cols) for u in updates]
        dtype = getattr(torch, group["ns_dtype"])
        stacked = updates[0].new_empty((sum(counts), rows, cols), dtype=dtype)
        for u, part in zip(updates, stacked.split(counts), strict=True):
            part.copy_(u.reshape(-1, rows, cols))
        ortho = ns(stacked, group["ns_steps"], dtype).to(params[0].dtype)
        orthos = [o.view(p.shape) for o, p in zip(ortho.split(counts), params, strict=True)]
        self._apply(params, orthos, group)
    return update_batch


def old_newton_schulz(update, steps=5, dtype=torch.float32, eps=1e-7):
    """Session 25's newton_schulz (5a8b3f1..0065a9e), verbatim."""
    a, b, c = NS_COEFFS
    x = update.to(dtype)
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        gram = x @ x.mT
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    if transposed:
        x = x.mT
    return x.to(update.dtype)


def old_update_batch(self, params, group):
    """Session 25's Muon._update_batch: the updates stacked in float32, then cast inside."""
    updates = self._momentum(params, group)
    rows, cols = params[0].shape[-2:]
    stacked = torch.cat([u.reshape(-1, rows, cols) for u in updates])
    ortho = old_newton_schulz(stacked, group["ns_steps"], getattr(torch, group["ns_dtype"]))
    counts = [u.numel() // (rows * cols) for u in updates]
    orthos = [o.view(p.shape) for o, p in zip(ortho.split(counts), params, strict=True)]
    self._apply(params, orthos, group)


VARIANTS = {"old": (old_update_batch, old_newton_schulz),
            "epilogue": (stacked_update_batch(epilogue_newton_schulz), epilogue_newton_schulz),
            "diagonal": (stacked_update_batch(diagonal_newton_schulz), diagonal_newton_schulz)}


def graph_of(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def median_replay_ms(g, iters=20):
    return statistics.median(timing.cuda_times_ms(g.replay, warmup=3, iters=iters))


def main() -> None:
    out = Path(sys.argv[1])
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = HybridLM(load_config("nam56r-350m")).to(dev)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    muon_params = [p for _, p in group_parameters(model).muon]
    shapes = []
    for batch in _same_shape_batches(muon_params):
        rows, cols = batch[0].shape[-2:]
        count = sum(p.numel() // (rows * cols) for p in batch)
        m, n = min(rows, cols), max(rows, cols)
        shapes.append({"shape": [rows, cols], "matrices": count,
                       "gflop_5_iters": 5 * count * (4 * m * m * n + 2 * m**3) / 1e9})
    peak = timing.matmul_peak_tflops()
    rows_out = []
    for round_ in range(2):
        for name, (update_batch, ns) in VARIANTS.items():
            Muon._update_batch = update_batch
            row = {"variant": name, "round": round_}
            opts = Optimizers(model, OptimSection(muon=True), dev, capturable=True)
            with opts.device_lr(dev):
                g = graph_of(opts.step)
            row["adamw_muon_ms"] = median_replay_ms(g)
            if round_ == 0:
                fams = family_breakdown(kernel_times_us(g.replay, calls=5).items())
                row["families"] = fams
                print(f"{name}: optimizer step by family\n{format_breakdown(fams)}", flush=True)
            del g, opts
            ns_rows = []
            for sh in shapes:
                x = torch.randn(sh["matrices"], *sh["shape"], device=dev)
                gx = graph_of(lambda x=x, ns=ns: ns(x.to(torch.bfloat16), 5, torch.bfloat16))
                ms = median_replay_ms(gx)
                ns_rows.append({**sh, "ms": ms, "tflops": sh["gflop_5_iters"] / ms})
                del gx, x
            row["newton_schulz"] = ns_rows
            row["newton_schulz_ms_total"] = sum(r["ms"] for r in ns_rows)
            rows_out.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("families",
                                                                        "newton_schulz")}),
                  flush=True)
            for r in ns_rows:
                print(f"  {r['shape']} x{r['matrices']}: {r['ms']:.3f} ms, {r['tflops']:.0f} TFLOP/s",
                      flush=True)
            torch.cuda.empty_cache()
    Muon._update_batch = NEW_UPDATE_BATCH
    opts = Optimizers(model, OptimSection(muon=False), dev, capturable=True)
    with opts.device_lr(dev):
        g = graph_of(opts.step)
    adamw_only = median_replay_ms(g)
    print(json.dumps({"adamw_only_ms": adamw_only, "matmul_peak_tflops": peak}), flush=True)
    result = {"device": torch.cuda.get_device_name(), "matmul_peak_tflops": peak,
              "adamw_only_ms": adamw_only, "rows": rows_out}
    out.write_text(json.dumps(result, indent=1))

    def med(name, key):
        return statistics.median(r[key] for r in rows_out if r["variant"] == name)

    metrics = {f"{v}_{k}": med(v, k) for v in VARIANTS
               for k in ("adamw_muon_ms", "newton_schulz_ms_total")}
    metrics.update(adamw_only_ms=adamw_only, matmul_peak_tflops=peak)
    write_receipt(out.with_suffix(".receipt.json"), "bench",
                  {"script": "benchmarks/results/train_h100_s26/optim_probe.py",
                   "model": "nam56r-350m", "ns_dtype": "bfloat16", "shapes": shapes},
                  metrics, [out])


if __name__ == "__main__":
    main()
