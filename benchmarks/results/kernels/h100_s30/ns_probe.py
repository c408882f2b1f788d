"""Device probe (session 30): Newton-Schulz with symmetric Triton products.

Each quintic iteration is A = X X^T, P = a I + b A + c A A, X = P X. A and P are symmetric, so
a kernel can compute only the tiles on and above the diagonal and store each off-diagonal tile
twice (itself and its transpose): about half the FLOPs of the first two products, and P is
formed in the product's epilogue from A's tile, so no copy of A into P's buffer (what
``torch.baddbmm`` does before its GEMM) and no separate diagonal add. The third product stays
cuBLAS's. This probe times, at nam56r-350m's Muon batches (all shapes, 5 iterations, CUDA-graph
replays): the trainer's ``newton_schulz`` (cuBLAS bmm + baddbmm), and the same iteration with
the Triton Gram and/or polynomial kernels at several tile settings; per-product times per
shape; and the error of each against a float64 iteration.

    PYTHONPATH=src python benchmarks/results/kernels/h100_s30/ns_probe.py OUT.json
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter

import torch
import triton
import triton.language as tl

from megacpp.kernels.timing import capture_graph, cuda_times_ms
from megacpp.model.config import load_config
from megacpp.model.model import HybridLM
from megacpp.train.optim import NS_COEFFS, group_parameters, newton_schulz


@triton.jit
def _upper(t, NT):
    """Linear index t over the tiles (i, j) with i <= j of an NT x NT grid, row by row."""
    i = 0
    rem = t
    while rem >= NT - i:
        rem -= NT - i
        i += 1
    return i, i + rem


@triton.jit
def _store_sym(OUT, b, i, j, val, M, so_b, so_m, so_n, BM: tl.constexpr):
    ri = i * BM + tl.arange(0, BM)
    rj = j * BM + tl.arange(0, BM)
    base = OUT + b.to(tl.int64) * so_b
    mask = (ri[:, None] < M) & (rj[None, :] < M)
    tl.store(base + ri[:, None] * so_m + rj[None, :] * so_n, val, mask=mask)
    if i != j:
        tl.store(base + rj[:, None] * so_m + ri[None, :] * so_n, tl.trans(val),
                 mask=(rj[:, None] < M) & (ri[None, :] < M))


@triton.jit
def _gram_kernel(X, A, M, N, sx_b, sx_m, sx_n, sa_b, sa_m, sa_n, NT,
                 BM: tl.constexpr, BK: tl.constexpr):
    i, j = _upper(tl.program_id(0), NT)
    b = tl.program_id(1)
    ri = i * BM + tl.arange(0, BM)
    rj = j * BM + tl.arange(0, BM)
    ks = tl.arange(0, BK)
    xb = X + b.to(tl.int64) * sx_b
    acc = tl.zeros((BM, BM), dtype=tl.float32)
    for k0 in range(0, N, BK):
        kk = k0 + ks
        xi = tl.load(xb + ri[:, None] * sx_m + kk[None, :] * sx_n,
                     mask=(ri[:, None] < M) & (kk[None, :] < N), other=0.0)
        xj = tl.load(xb + rj[:, None] * sx_m + kk[None, :] * sx_n,
                     mask=(rj[:, None] < M) & (kk[None, :] < N), other=0.0)
        acc = tl.dot(xi, tl.trans(xj), acc)
    _store_sym(A, b, i, j, acc.to(A.dtype.element_ty), M, sa_b, sa_m, sa_n, BM)


@triton.jit
def _poly_kernel(A, P, M, sa_b, sa_m, sa_n, sp_b, sp_m, sp_n, NT, ca, cb, cc,
                 BM: tl.constexpr, BK: tl.constexpr):
    i, j = _upper(tl.program_id(0), NT)
    b = tl.program_id(1)
    ri = i * BM + tl.arange(0, BM)
    rj = j * BM + tl.arange(0, BM)
    ks = tl.arange(0, BK)
    ab = A + b.to(tl.int64) * sa_b
    acc = tl.zeros((BM, BM), dtype=tl.float32)
    for k0 in range(0, M, BK):
        kk = k0 + ks
        left = tl.load(ab + ri[:, None] * sa_m + kk[None, :] * sa_n,
                       mask=(ri[:, None] < M) & (kk[None, :] < M), other=0.0)
        right = tl.load(ab + kk[:, None] * sa_m + rj[None, :] * sa_n,  # A[k, j] (symmetric)
                        mask=(kk[:, None] < M) & (rj[None, :] < M), other=0.0)
        acc = tl.dot(left, right, acc)
    aij = tl.load(ab + ri[:, None] * sa_m + rj[None, :] * sa_n,
                  mask=(ri[:, None] < M) & (rj[None, :] < M), other=0.0).to(tl.float32)
    val = cc * acc + cb * aij + tl.where(ri[:, None] == rj[None, :], ca, 0.0)
    _store_sym(P, b, i, j, val.to(P.dtype.element_ty), M, sp_b, sp_m, sp_n, BM)


def gram(x, bm, bk, warps, stages):
    batch, m, n = x.shape
    out = x.new_empty(batch, m, m)
    nt = triton.cdiv(m, bm)
    _gram_kernel[(nt * (nt + 1) // 2, batch)](x, out, m, n, *x.stride(), *out.stride(), nt,
                                              BM=bm, BK=bk, num_warps=warps, num_stages=stages)
    return out


def poly(a_mat, bm, bk, warps, stages):
    batch, m, _ = a_mat.shape
    out = torch.empty_like(a_mat)
    nt = triton.cdiv(m, bm)
    ca, cb, cc = NS_COEFFS
    _poly_kernel[(nt * (nt + 1) // 2, batch)](a_mat, out, m, *a_mat.stride(), *out.stride(), nt,
                                              ca, cb, cc, BM=bm, BK=bk, num_warps=warps,
                                              num_stages=stages)
    return out


def ns_triton(update, steps, gram_cfg, poly_cfg, eps=1e-7):
    """newton_schulz's iteration with the Triton products (None: cuBLAS's for that product)."""
    a, b, c = NS_COEFFS
    x = update.to(torch.bfloat16)
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    shape = x.shape
    x = x.reshape(-1, *shape[-2:]).contiguous()
    for i in range(steps):
        g = gram(x, *gram_cfg) if gram_cfg else torch.bmm(x, x.mT)
        if poly_cfg:
            p = poly(g, *poly_cfg)
        else:
            p = torch.baddbmm(g, g, g, beta=b, alpha=c)
            p.diagonal(dim1=-2, dim2=-1).add_(a)
        if transposed and i == steps - 1:
            return torch.bmm(x.mT, p).reshape(shape[:-2] + shape[-2:][::-1]).to(update.dtype)
        x = torch.bmm(p, x)
    x = x.reshape(shape)
    if transposed:
        x = x.mT
    return x.to(update.dtype)


def ns_float64(update, steps=5, eps=1e-7):
    a, b, c = NS_COEFFS
    x = update.double()
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        g = x @ x.mT
        x = a * x + (b * g + c * g @ g) @ x
    return x.mT if transposed else x


def batches():
    """nam56r-350m's Muon batches as the optimizer stacks them: (matrices, rows, cols)."""
    with torch.device("meta"):
        model = HybridLM(load_config("nam56r-350m"))
    counts = Counter()
    for _, p in group_parameters(model).muon:
        lead = p.numel() // (p.shape[-2] * p.shape[-1])
        counts[tuple(p.shape[-2:])] += lead
    return [(n, r, c) for (r, c), n in counts.items()]


CONFIGS = {  # (BM, BK, warps, stages)
    "t128_k64_w8_s3": (128, 64, 8, 3),
    "t128_k64_w4_s3": (128, 64, 4, 3),
    "t128_k64_w8_s4": (128, 64, 8, 4),
    "t64_k64_w4_s3": (64, 64, 4, 3),
    "t64_k128_w4_s3": (64, 128, 4, 3),
}


def timed(fn):
    graph, _ = capture_graph(fn, warmup=2)
    return statistics.median(cuda_times_ms(graph.replay, warmup=3, iters=20))


def main() -> None:
    out = sys.argv[1]
    torch.manual_seed(0)
    shapes = batches()
    data = [torch.randn(n, r, c, device="cuda", dtype=torch.bfloat16) for n, r, c in shapes]
    result = {"device": torch.cuda.get_device_name(), "shapes": shapes, "whole": {},
              "per_shape": {}, "error": {}}
    # accuracy: each variant against float64, on one matrix of each shape
    for (n, r, c), x in zip(shapes, data, strict=True):
        ref = ns_float64(x[:4])
        errs = {"cublas": ((newton_schulz(x[:4], 5, torch.bfloat16).double() - ref).norm()
                           / ref.norm()).item()}
        for name, cfg in CONFIGS.items():
            got = ns_triton(x[:4], 5, cfg, cfg).double()
            errs[name] = ((got - ref).norm() / ref.norm()).item()
        result["error"][f"{n}x{r}x{c}"] = errs
        print(f"{n}x{r}x{c} error vs float64", {k: f"{v:.4f}" for k, v in errs.items()})
    # whole Newton-Schulz over all batches, as one step runs it
    variants = {"cublas": lambda: [newton_schulz(x, 5, torch.bfloat16) for x in data]}
    for name, cfg in CONFIGS.items():
        variants[f"both_{name}"] = lambda cfg=cfg: [ns_triton(x, 5, cfg, cfg) for x in data]
    variants["gram_only_t128_k64_w8_s3"] = lambda: [
        ns_triton(x, 5, CONFIGS["t128_k64_w8_s3"], None) for x in data]
    variants["poly_only_t128_k64_w8_s3"] = lambda: [
        ns_triton(x, 5, None, CONFIGS["t128_k64_w8_s3"]) for x in data]
    for round_ in range(2):
        for name, fn in variants.items():
            ms = timed(fn)
            result["whole"].setdefault(name, []).append(ms)
            print(f"round {round_} whole NS {name}: {ms:.3f} ms")
    # per product, per shape
    for (n, r, c), x in zip(shapes, data, strict=True):
        xt = (x.mT if r > c else x).contiguous()
        g = torch.bmm(xt, xt.mT)
        row = {"bmm_gram": timed(lambda xt=xt: torch.bmm(xt, xt.mT)),
               "baddbmm_poly": timed(lambda g=g: torch.baddbmm(g, g, g, beta=-4.775,
                                                               alpha=2.0315)),
               "bmm_px": timed(lambda g=g, xt=xt: torch.bmm(g, xt))}
        for name, cfg in CONFIGS.items():
            row[f"gram_{name}"] = timed(lambda cfg=cfg, xt=xt: gram(xt, *cfg))
            row[f"poly_{name}"] = timed(lambda cfg=cfg, g=g: poly(g, *cfg))
        result["per_shape"][f"{n}x{r}x{c}"] = row
        print(f"{n}x{r}x{c}", {k: f"{v * 1e3:.0f}us" for k, v in row.items()})
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
