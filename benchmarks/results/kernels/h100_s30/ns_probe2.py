"""Device probe (session 30, call 2): the symmetric Newton-Schulz products of ns_probe.py with
tensor-descriptor (TMA) loads, swept per shape of nam56r-350m's Muon batches.

A = X X^T (gram) and P = a I + b A + c A A (poly), only tiles i <= j computed, each
off-diagonal tile also stored transposed. Operands through 3-D descriptors [batch, rows, cols]
(a block past a matrix's edge reads zeros, never the next matrix). Per shape: cuBLAS's bmm
(gram) and baddbmm + diagonal add (poly), then each setting (BM, BK, warps, stages); then the
whole 5-iteration Newton-Schulz over all batches with, per shape and product, the faster of
cuBLAS and the best setting, against the trainer's newton_schulz; the error of each against
float64. CUDA-graph replays, median of 20.

    PYTHONPATH=src python benchmarks/results/kernels/h100_s30/ns_probe2.py OUT.json
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from ns_probe import batches, ns_float64

from megacpp.kernels.timing import capture_graph, cuda_times_ms
from megacpp.train.optim import NS_COEFFS, newton_schulz


@triton.jit
def _upper(t, NT):
    i = 0
    rem = t
    while rem >= NT - i:
        rem -= NT - i
        i += 1
    return i, i + rem


@triton.jit
def _store_sym(OUT, b, i, j, val, M, BM: tl.constexpr):
    ri = i * BM + tl.arange(0, BM)
    rj = j * BM + tl.arange(0, BM)
    base = OUT + b.to(tl.int64) * M * M
    tl.store(base + ri[:, None] * M + rj[None, :], val,
             mask=(ri[:, None] < M) & (rj[None, :] < M))
    if i != j:
        tl.store(base + rj[:, None] * M + ri[None, :], tl.trans(val),
                 mask=(rj[:, None] < M) & (ri[None, :] < M))


@triton.jit
def _gram_tma(X, A, M, N, NT, BM: tl.constexpr, BK: tl.constexpr):
    i, j = _upper(tl.program_id(0), NT)
    b = tl.program_id(1)
    acc = tl.zeros((BM, BM), dtype=tl.float32)
    for k0 in range(0, N, BK):
        xi = X.load([b, i * BM, k0]).reshape(BM, BK)
        xj = X.load([b, j * BM, k0]).reshape(BM, BK)
        acc = tl.dot(xi, xj.T, acc)
    _store_sym(A, b, i, j, acc.to(A.dtype.element_ty), M, BM)


@triton.jit
def _poly_tma(A, AP, P, M, NT, ca, cb, cc, BM: tl.constexpr, BK: tl.constexpr):
    i, j = _upper(tl.program_id(0), NT)
    b = tl.program_id(1)
    acc = tl.zeros((BM, BM), dtype=tl.float32)
    for k0 in range(0, M, BK):
        left = A.load([b, i * BM, k0]).reshape(BM, BK)
        right = A.load([b, j * BM, k0]).reshape(BM, BK)  # A[k, j] = A[j, k]
        acc = tl.dot(left, right.T, acc)
    ri = i * BM + tl.arange(0, BM)
    rj = j * BM + tl.arange(0, BM)
    aij = tl.load(AP + b.to(tl.int64) * M * M + ri[:, None] * M + rj[None, :],
                  mask=(ri[:, None] < M) & (rj[None, :] < M), other=0.0).to(tl.float32)
    val = cc * acc + cb * aij + tl.where(ri[:, None] == rj[None, :], ca, 0.0)
    _store_sym(P, b, i, j, val.to(P.dtype.element_ty), M, BM)


def gram(x, bm, bk, warps, stages):
    batch, m, n = x.shape
    out = x.new_empty(batch, m, m)
    nt = triton.cdiv(m, bm)
    _gram_tma[(nt * (nt + 1) // 2, batch)](TensorDescriptor.from_tensor(x, [1, bm, bk]), out,
                                          m, n, nt, BM=bm, BK=bk, num_warps=warps,
                                          num_stages=stages)
    return out


def poly(a_mat, bm, bk, warps, stages):
    batch, m, _ = a_mat.shape
    out = torch.empty_like(a_mat)
    nt = triton.cdiv(m, bm)
    ca, cb, cc = NS_COEFFS
    _poly_tma[(nt * (nt + 1) // 2, batch)](TensorDescriptor.from_tensor(a_mat, [1, bm, bk]),
                                          a_mat, out, m, nt, ca, cb, cc, BM=bm, BK=bk,
                                          num_warps=warps, num_stages=stages)
    return out


def cublas_gram(x):
    return torch.bmm(x, x.mT)


def cublas_poly(g):
    a, b, c = NS_COEFFS
    p = torch.baddbmm(g, g, g, beta=b, alpha=c)
    p.diagonal(dim1=-2, dim2=-1).add_(a)
    return p


def ns(update, steps, gram_fn, poly_fn, eps=1e-7):
    x = update.to(torch.bfloat16)
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    shape = x.shape
    x = x.reshape(-1, *shape[-2:]).contiguous()
    for i in range(steps):
        p = poly_fn(gram_fn(x))
        if transposed and i == steps - 1:
            return torch.bmm(x.mT, p).reshape(shape[:-2] + shape[-2:][::-1]).to(update.dtype)
        x = torch.bmm(p, x)
    x = x.reshape(shape)
    return (x.mT if transposed else x).to(update.dtype)


SETTINGS = [cfg for cfg in itertools.product((64, 128), (64, 128), (4, 8), (3, 4))
            if not (cfg[0] == 128 and cfg[1] == 128 and cfg[3] == 4)]  # shared memory


def timed(fn):
    try:
        graph, _ = capture_graph(fn, warmup=2)
    except Exception as exc:  # noqa: BLE001 -- a setting past the shared memory: no time
        print("  failed", type(exc).__name__, str(exc).splitlines()[0][:120])
        return None
    return statistics.median(cuda_times_ms(graph.replay, warmup=3, iters=20))


def main() -> None:
    out = sys.argv[1]
    torch.manual_seed(0)
    shapes = batches()
    data = [torch.randn(n, r, c, device="cuda", dtype=torch.bfloat16) for n, r, c in shapes]
    result = {"device": torch.cuda.get_device_name(), "settings": SETTINGS, "per_shape": {},
              "best": {}, "whole": {}, "error": {}}
    best = {}
    for (n, r, c), x in zip(shapes, data, strict=True):
        xt = (x.mT if r > c else x).contiguous()
        xt = xt / xt.norm(dim=(-2, -1), keepdim=True)
        g = cublas_gram(xt)
        row = {"cublas_gram": timed(lambda xt=xt: cublas_gram(xt)),
               "cublas_poly": timed(lambda g=g: cublas_poly(g))}
        # agreement with the pointer-load kernels' math (cuBLAS's rounding aside)
        got_g, got_p = gram(xt, 64, 64, 4, 3), poly(g, 64, 64, 4, 3)
        row["gram_maxrel"] = ((got_g.float() - g.float()).abs().max() / g.float().abs().max()).item()
        want_p = cublas_poly(g)
        row["poly_maxrel"] = ((got_p.float() - want_p.float()).abs().max()
                              / want_p.float().abs().max()).item()
        for cfg in SETTINGS:
            key = "_".join(map(str, cfg))
            row[f"gram_{key}"] = timed(lambda cfg=cfg, xt=xt: gram(xt, *cfg))
            row[f"poly_{key}"] = timed(lambda cfg=cfg, g=g: poly(g, *cfg))
        pick = {}
        for kind in ("gram", "poly"):
            tried = {cfg: row[f"{kind}_{'_'.join(map(str, cfg))}"] for cfg in SETTINGS}
            cfg, ms = min(((k, v) for k, v in tried.items() if v is not None), key=lambda kv: kv[1])
            pick[kind] = cfg if ms < row[f"cublas_{kind}"] else None
            print(f"{n}x{r}x{c} {kind}: cuBLAS {row[f'cublas_{kind}'] * 1e3:.0f} us, best "
                  f"{cfg} {ms * 1e3:.0f} us")
        best[(n, r, c)] = pick
        result["per_shape"][f"{n}x{r}x{c}"] = row
        result["best"][f"{n}x{r}x{c}"] = pick
        print(f"  maxrel gram {row['gram_maxrel']:.2e} poly {row['poly_maxrel']:.2e}")

    def fns(shape, which):
        pick = best[shape]
        gfn = (lambda x: gram(x, *pick["gram"])) if pick["gram"] and which != "poly" else cublas_gram
        pfn = (lambda a: poly(a, *pick["poly"])) if pick["poly"] and which != "gram" else cublas_poly
        return gfn, pfn

    variants = {"cublas (newton_schulz)": lambda: [newton_schulz(x, 5, torch.bfloat16) for x in data]}
    for which in ("both", "poly", "gram"):
        variants[f"best {which}"] = lambda which=which: [
            ns(x, 5, *fns(s, which)) for s, x in zip(shapes, data, strict=True)]
    for round_ in range(3):
        for name, fn in variants.items():
            ms = timed(fn)
            result["whole"].setdefault(name, []).append(ms)
            print(f"round {round_} whole NS {name}: {ms:.3f} ms")
    for s, x in zip(shapes, data, strict=True):
        ref = ns_float64(x[:4])
        errs = {"cublas": newton_schulz(x[:4], 5, torch.bfloat16),
                "best both": ns(x[:4], 5, *fns(s, "both"))}
        result["error"]["x".join(map(str, s))] = {
            k: ((v.double() - ref).norm() / ref.norm()).item() for k, v in errs.items()}
    print("error vs float64", result["error"])
    with open(out, "w") as f:
        json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
