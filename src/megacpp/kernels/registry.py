"""The project's catalog rows: every surface, its reference, and its chosen / donor /
deferred backends with requirements and reasons. :func:`default_catalog` is the one instance
the CLI, the model and the benchmark use."""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable
from typing import Any

import torch

from megacpp._compile import disable
from megacpp.kernels.catalog import Backend, Catalog, Requirements, Surface
from megacpp.kernels.ops.attention.document import (
    document_attention_flex,
    document_attention_reference,
)
from megacpp.kernels.ops.attention.reference import (
    causal_attention_reference,
    causal_attention_sdpa_flash,
)
from megacpp.kernels.ops.gated_delta.reference import (
    flops_per_token as gated_delta_flops_per_token,
)
from megacpp.kernels.ops.gated_delta.reference import gated_delta_rule_chunked
from megacpp.kernels.ops.linear_ce.reference import (
    linear_cross_entropy_reference,
    linear_cross_entropy_torch,
)
from megacpp.kernels.ops.mamba3_scan.reference import mamba3_scan_chunked
from megacpp.kernels.ops.moe.reference import moe_experts_reference
from megacpp.kernels.ops.muon.reference import (
    NS_COEFFS,
    muon_apply_reference,
    muon_momentum_reference,
    muon_polynomial_reference,
)
from megacpp.kernels.ops.rmsnorm.reference import rmsnorm_reference
from megacpp.kernels.ops.short_conv.reference import short_conv_reference
from megacpp.kernels.peers import fla_check_guard

FLOATS = ("float32", "bfloat16", "float16")
HALF = ("bfloat16", "float16")


def _lazy(module: str, attr: str) -> Callable[..., Any]:
    """A callable that imports ``module`` on first use (Triton / peers stay optional).

    Opaque to ``torch.compile``: a compiled model (``MEGACPP_KERNELS=fast``) runs our kernels
    as they are, between compiled regions (a graph break per call), instead of tracing into
    their host code."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), attr)(*args, **kwargs)

    call.__name__ = call.__qualname__ = f"{module}.{attr}"
    return disable(call)


def _randn(shape: tuple[int, ...], dtype: torch.dtype, device: Any, gen: torch.Generator,
           scale: float = 1.0, grad: bool = True) -> torch.Tensor:
    t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * scale
    return t.to(dtype).requires_grad_(grad)


# -- rmsnorm ------------------------------------------------------------------------------------
def _rmsnorm_inputs(case: dict[str, int], dtype, device, gen) -> dict[str, Any]:
    t, d = case["tokens"], case["dim"]
    return {"x": _randn((t, d), dtype, device, gen), "residual": _randn((t, d), dtype, device, gen),
            "weight": (1 + 0.1 * torch.randn(d, generator=gen, device=device)).requires_grad_(),
            "eps": 1e-5}


def _rmsnorm_bytes(inp: dict[str, Any]) -> float:
    # fwd: read x, residual; write y, h.  bwd: read dy, dh_out, h; write dh.
    return 8 * inp["x"].numel() * inp["x"].element_size()


# -- linear cross-entropy -----------------------------------------------------------------------
def _linear_ce_inputs(case: dict[str, int], dtype, device, gen) -> dict[str, Any]:
    t, d, v = case["tokens"], case["hidden"], case["vocab"]
    labels = torch.randint(0, v, (t,), generator=gen, device=device)
    labels[torch.rand(t, generator=gen, device=device) < 0.05] = -100  # some ignored rows
    return {"h": _randn((t, d), dtype, device, gen),
            "weight": _randn((v, d), dtype, device, gen, scale=d**-0.5), "labels": labels}


def _linear_ce_flops(inp: dict[str, Any]) -> float:
    (t, d), v = inp["h"].shape, inp["weight"].shape[0]
    return 3 * 2 * t * d * v  # logits, dh, dW


# -- MoE experts --------------------------------------------------------------------------------
def _moe_inputs(case: dict[str, int], dtype, device, gen) -> dict[str, Any]:
    t, d, e, k, f = case["tokens"], case["dim"], case["experts"], case["top_k"], case["ffn"]
    scores = torch.rand(t, e, generator=gen, device=device)
    expert_idx = scores.topk(k, dim=-1).indices  # distinct experts per token
    weights = torch.rand(t, k, generator=gen, device=device) + 0.1
    return {"x": _randn((t, d), dtype, device, gen), "expert_idx": expert_idx,
            "weights": (weights / weights.sum(-1, keepdim=True)).requires_grad_(),
            "w_in": _randn((e, 2 * f, d), dtype, device, gen, scale=d**-0.5),
            "w_out": _randn((e, d, f), dtype, device, gen, scale=f**-0.5)}


def _moe_flops(inp: dict[str, Any]) -> float:
    routed = inp["expert_idx"].numel()
    (_, two_f, d) = inp["w_in"].shape
    return 3 * 2 * routed * d * (two_f + two_f // 2)  # fwd + 2x for bwd


# -- attention ----------------------------------------------------------------------------------
def _attention_inputs(case: dict[str, int], dtype, device, gen) -> dict[str, Any]:
    shape = (case["batch"], case["heads"], case["seq"], case["head_dim"])
    return {name: _randn(shape, dtype, device, gen) for name in ("q", "k", "v")}


def _attention_flops(inp: dict[str, Any]) -> float:
    b, h, length, dh = inp["q"].shape
    return 3.5 * 4 * b * h * length * length * dh / 2  # causal half; bwd = 2.5x fwd


def _document_ids(batch: int, length: int, docs: int, device, gen) -> torch.Tensor:
    """[B, L] int64 ids of ``docs`` contiguous documents per row, random lengths (>= 1)."""
    rows = []
    for _ in range(batch):
        cuts = torch.randperm(length - 1, generator=gen, device=device)[: docs - 1] + 1
        starts = torch.zeros(length, dtype=torch.int64, device=device)
        starts[cuts] = 1
        rows.append(starts.cumsum(0))
    return torch.stack(rows)


def _document_attention_inputs(case: dict[str, int], dtype, device, gen) -> dict[str, Any]:
    b, length, dh = case["batch"], case["seq"], case["head_dim"]
    inputs = {name: _randn((b, h, length, dh), dtype, device, gen)
              for name, h in (("q", case["heads"]), ("k", case["kv_heads"]),
                              ("v", case["kv_heads"]))}
    inputs["doc_ids"] = _document_ids(b, length, case["docs"], device, gen)
    return inputs


def _document_attention_flops(inp: dict[str, Any]) -> float:
    """fwd+bwd (3.5x the forward) over the (query, key) pairs each document leaves visible."""
    _, h, _, dh = inp["q"].shape
    pairs = 0.0
    for row in inp["doc_ids"]:
        n = torch.unique_consecutive(row, return_counts=True)[1].double()
        pairs += float((n * (n + 1) / 2).sum())
    return 3.5 * 4 * h * dh * pairs


# -- Mamba-3 scan -------------------------------------------------------------------------------
def _mamba3_inputs(case: dict[str, int], dtype, device, gen) -> dict[str, Any]:
    """Model-like scan inputs: q/k RMS-normed, dt = softplus(.) and adt = A dt <= 0 in float32
    (as the mixer makes them), per-head float32 biases and D; packed documents if asked."""
    b, length, g, h = case["batch"], case["seq"], case["groups"], case["heads"]
    n, p, r = case["d_state"], case["headdim"], case["angles"]

    def rn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device) * scale

    dt = torch.nn.functional.softplus(rn(b, length, h) - 2)
    inputs = {
        "q": torch.nn.functional.rms_norm(rn(b, length, g, n), (n,)).to(dtype),
        "k": torch.nn.functional.rms_norm(rn(b, length, g, n), (n,)).to(dtype),
        "v": rn(b, length, h, p).to(dtype),
        "adt": -torch.rand(b, length, h, generator=gen, device=device) * dt,
        "dt": dt,
        "trap": rn(b, length, h).to(dtype),
        "q_bias": 1 + rn(h, n, scale=0.1), "k_bias": 1 + rn(h, n, scale=0.1),
        "angles": rn(b, length, h, r, scale=2.0).to(dtype),
        "D": rn(h),
        "z": rn(b, length, h, p).to(dtype),
    }
    inputs = {name: t.requires_grad_() for name, t in inputs.items()}
    if case.get("resets"):
        reset = torch.rand(b, length, generator=gen, device=device) < 4 / length
        reset[:, 0] = False
        inputs["reset"] = reset
    inputs["chunk_size"] = case["chunk"]
    # the bench cases time what a training step runs (and the mamba_ssm peer returns): y only
    inputs["output_final_state"] = bool(case.get("final_state", 1))
    return inputs


def _mamba3_flops(inp: dict[str, Any]) -> float:
    """Forward matmul FLOPs of the chunked form, times 3 for forward + backward."""
    from megacpp.kernels.ops.mamba3_scan.reference import flops_per_token

    b, length, h, p = inp["v"].shape
    per_token = flops_per_token(length, inp["chunk_size"], h, p, inp["q"].shape[-1])
    return 3 * b * length * per_token


def _mamba3_bytes(inp: dict[str, Any]) -> float:
    """Fewest bytes of forward + backward: each differentiable input read by the forward and
    the backward and its gradient written (3x), y written and dy read (2x v)."""
    grads = ("q", "k", "v", "adt", "dt", "trap", "q_bias", "k_bias", "angles", "D", "z")
    read3 = sum(inp[name].numel() * inp[name].element_size() for name in grads)
    return 3 * read3 + 2 * inp["v"].numel() * inp["v"].element_size()


# -- gated delta rule ---------------------------------------------------------------------------
def _gated_delta_inputs(case: dict[str, int], dtype, device, gen) -> dict[str, Any]:
    """The mixer's call: unit-norm q and k (it L2-normalises them), g = log decay <= 0 and
    beta in (0, 1) in float32, doc resets every ~doc_len tokens (0: none)."""
    B, L, H = case["batch"], case["seq"], case["heads"]
    K, V = case["head_k"], case["head_v"]

    def unit(shape):
        x = torch.randn(shape, generator=gen, device=device)
        return (x / x.norm(dim=-1, keepdim=True)).to(dtype).requires_grad_()

    def f32(shape, shift=0.0):
        return torch.randn(shape, generator=gen, device=device) + shift

    reset = None
    if case.get("doc_len"):
        reset = torch.rand(B, L, generator=gen, device=device) < 1.0 / case["doc_len"]
    return {"q": unit((B, L, H, K)), "k": unit((B, L, H, K)),
            "v": _randn((B, L, H, V), dtype, device, gen),
            "g": torch.nn.functional.logsigmoid(f32((B, L, H), 2.0)).requires_grad_(),
            "beta": torch.sigmoid(f32((B, L, H))).requires_grad_(),
            "reset": reset, "output_final_state": bool(case.get("final_state", 0))}


def _gated_delta_flops(inp: dict[str, Any]) -> float:
    B, L, H, K = inp["q"].shape
    V = inp["v"].shape[-1]
    return 3 * B * L * gated_delta_flops_per_token(L, H, K, V)  # fwd matmuls; bwd ~ 2x fwd


def _gated_delta_bytes(inp: dict[str, Any]) -> float:
    # fwd: read q, k, v, g, beta; write o.  bwd: read them again and do; write every grad.
    B, L, H, K = inp["q"].shape
    V = inp["v"].shape[-1]
    qkv = (2 * K + V) * inp["q"].element_size()
    o = V * inp["q"].element_size()
    gates = 2 * 4  # g and beta, float32
    return B * L * H * (3 * qkv + 2 * o + 3 * gates)


# -- short conv ---------------------------------------------------------------------------------
def _short_conv_inputs(case: dict[str, int], dtype, device, gen) -> dict[str, Any]:
    """x as the channel slice of a wider projection output (as the R mixer's in_proj split
    gives it), a weight, packed documents of ~``doc_len`` tokens."""
    b, length, c, w = case["batch"], case["seq"], case["channels"], case["taps"]
    wide = _randn((b, length, c + case.get("pad", 0)), dtype, device, gen, grad=False)
    starts = torch.rand(b, length, generator=gen, device=device) < 1 / case["doc_len"]
    return {"x": wide[..., :c].requires_grad_(),
            "weight": _randn((c, w), torch.float32, device, gen, scale=w**-0.5),
            "doc_ids": starts.cumsum(1)}


def _short_conv_bytes(inp: dict[str, Any]) -> float:
    # fwd: read x, write y.  bwd: read x, dy; write dx (the weight and doc ids are small).
    return 5 * inp["x"].numel() * inp["x"].element_size()


# -- muon_polynomial (Newton-Schulz's a I + b A + c A A; forward only) ------------------------


def _muon_polynomial_inputs(case: dict[str, int], dtype, device, gen) -> dict[str, Any]:
    """gram = X X^T of a random X [batch, m, cols] (m <= cols: NS works on the wide side):
    symmetric positive semi-definite, as Newton-Schulz hands it over, with Muon's
    coefficients. ``normalize`` 1: X left unnormalized and the surface scales it (NS's first
    step); 0: X normalized first (||X||_F = 1, the later steps)."""
    shape = (case["batch"], case["m"], case["cols"])
    x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    if not case["normalize"]:
        x = x / x.norm(dim=(-2, -1), keepdim=True)
    x = x.to(dtype)
    # the Gram matrix in the operand dtype (a float32 product, rounded once), exactly symmetric
    gram = torch.matmul(x.float(), x.float().mT)
    gram = ((gram + gram.mT) / 2).to(dtype)
    return {"gram": gram, **dict(zip("abc", NS_COEFFS, strict=True)),
            "normalize_eps": 1e-7 if case["normalize"] else None}


def _muon_polynomial_flops(inp: dict[str, Any]) -> float:
    # A A as a full product (2 m^3 per matrix); symmetric kernels compute half of it
    *lead, m, _ = inp["gram"].shape
    return 2.0 * math.prod(lead) * m**3


def _muon_polynomial_bytes(inp: dict[str, Any]) -> float:
    return 2 * inp["gram"].numel() * inp["gram"].element_size()  # read A, write P


def _surfaces() -> list[Surface]:
    return [
        Surface(
            "rmsnorm",
            "x, residual [T, D] (any float dtype), weight [D] -> (y, h) [T, D] in x.dtype; "
            "h = x + residual (fp32 sum), y = h * rsqrt(mean(h^2) + eps) * weight; "
            "fanout=n (<= 3): y n times then h, each copy with its own gradient, summed by the "
            "backward; "
            "rope=(cos, sin) [L, D/2] (a QK-norm of x [..., L, D]; no residual, fanout 1): y "
            "rotated (half-split pairs, as apply_rope) before its one rounding; x may be a "
            "strided view (read in place, dx with its strides); saves h, weight, rstd [T] fp32 "
            "(and the tables)",
            rmsnorm_reference, _rmsnorm_inputs,
            # bench: 262144 rows (4 GiB moved); at 16384 rows the ~0.1 ms of kernels hide
            # under ~0.8 ms of host launch time and every backend measures the host
            {"check": {"tokens": 67, "dim": 384}, "bench": {"tokens": 262144, "dim": 1024}},
            ("x", "residual", "weight"), None, _rmsnorm_bytes,
        ),
        Surface(
            "linear_cross_entropy",
            "h [T, D], weight [V, D] (same dtype), labels [T] int64 (-100 ignored) -> mean loss "
            "fp32 scalar; fused backend never holds [T, V] logits (one token chunk of <= 128 MiB "
            "at a time), computes the grads in forward with fp32 sums (dW accumulated by cuBLAS "
            "addmm into an fp32 [V, D] held as two row halves; backward casts the first half "
            "into a temporary and frees it before allocating the result: never fp32 dW + a full "
            "cast copy); keeps dh + the fp32 dW for backward, which scales them in place (a "
            "second backward is an error)",
            linear_cross_entropy_reference, _linear_ce_inputs,
            {"check": {"tokens": 300, "hidden": 64, "vocab": 1000},
             "bench": {"tokens": 16384, "hidden": 1024, "vocab": 65536}},
            ("h", "weight"), _linear_ce_flops,
        ),
        Surface(
            "moe_experts",
            "x [T, D], expert_idx [T, k] int64, weights [T, k], w_in [E, 2F, D] (gate|up), "
            "w_out [E, D, F], optional addend [T, D] -> [T, D] = sum_j w[t,j] * SwiGLU_e(x[t]) "
            "(+ addend[t], summed in the combine); dropless; grouped "
            "backend: no host sync (device offsets), routing weight folded into the SwiGLU "
            "output, fp32 gather-sum combine; saves permuted x, gate|up, weighted SwiGLU "
            "output and the dispatch plan",
            moe_experts_reference, _moe_inputs,
            {"check": {"tokens": 96, "dim": 64, "experts": 8, "top_k": 2, "ffn": 32},
             "e64_k8": {"tokens": 16384, "dim": 1024, "experts": 64, "top_k": 8, "ffn": 512},
             "e16_k2": {"tokens": 16384, "dim": 1024, "experts": 16, "top_k": 2, "ffn": 2048}},
            ("x", "weights", "w_in", "w_out"), _moe_flops,
        ),
        Surface(
            "attention",
            "q, k, v [B, H, L, Dh] (GQA expanded), causal, scale 1/sqrt(Dh) -> [B, H, L, Dh]; "
            "flash saves q, k, v, out and logsumexp [B, H, L] fp32",
            causal_attention_reference, _attention_inputs,
            {"check": {"batch": 2, "heads": 4, "seq": 128, "head_dim": 64},
             "bench": {"batch": 8, "heads": 16, "seq": 2048, "head_dim": 64}},
            ("q", "k", "v"), _attention_flops,
        ),
        Surface(
            "document_attention",
            "q [B, H, L, Dh], k, v [B, Hkv, L, Dh] (H a multiple of Hkv), doc_ids [B, L] int -> "
            "[B, H, L, Dh] in q.dtype: query i sees key j iff j <= i and both are in one "
            "document, scale 1/sqrt(Dh) (the model's attention over packed rows); flex: "
            "FlexAttention over a [128, 128]-tile block mask made from doc_ids (empty tiles "
            "skipped, full ones unmasked; on sm90 at head dim 64 in bf16 / fp16, 64-row "
            "kernel tiles: flex_kernel_options), saves q, k, v, out and logsumexp; reference: SDPA "
            "with the dense [B, 1, L, L] mask",
            document_attention_reference, _document_attention_inputs,
            {"check": {"batch": 2, "heads": 4, "kv_heads": 2, "seq": 300, "head_dim": 64,
                       "docs": 3},
             "step": {"batch": 8, "heads": 12, "kv_heads": 2, "seq": 2048, "head_dim": 64,
                      "docs": 2}},
            ("q", "k", "v"), _document_attention_flops,
        ),
        Surface(
            "mamba3_scan",
            "Mamba-3 SISO chunked scan: q, k [B, L, G, N], v, z [B, L, H, P], adt/dt/trap "
            "[B, L, H], angles [B, L, H, R], biases [H, N], D [H], reset [B, L] bool -> y "
            "[B, L, H, P] in v.dtype + final state (float32; None with output_final_state=False, "
            "what a training step without a cache asks); fp32 accumulation. triton_chunked: "
            "initial_state=None only (a cached prefill runs the reference: the mixer picks it), "
            "chunk_size 16/32/64 (fp32 v runs chunks of <= 32 tokens: same function), headdim "
            "<= 64, d_state <= 128, no gradient through the final state; bf16 matmul operands "
            "unless v is fp32; saves the inputs, the state entering every chunk [B, H, L/T, P, "
            "N] (bf16; fp32 for fp32 v), the per-head rotation table (cos, sin of the in-chunk "
            "angle) [B, H, L, 2, R] (fp16; fp32 for fp32 v) and y before the gate",
            mamba3_scan_chunked, _mamba3_inputs,
            {"check": {"batch": 2, "seq": 300, "groups": 2, "heads": 4, "d_state": 64,
                       "headdim": 64, "angles": 16, "chunk": 64, "resets": 1},
             "seq4096": {"batch": 8, "seq": 4096, "groups": 1, "heads": 32, "d_state": 128,
                         "headdim": 64, "angles": 32, "chunk": 64, "final_state": 0},
             "seq8192": {"batch": 8, "seq": 8192, "groups": 1, "heads": 32, "d_state": 128,
                         "headdim": 64, "angles": 32, "chunk": 64, "final_state": 0}},
            ("q", "k", "v", "adt", "dt", "trap", "q_bias", "k_bias", "angles", "D", "z"),
            _mamba3_flops, _mamba3_bytes,
        ),
        Surface(
            "short_conv",
            "x [B, L, C] (unit channel stride: a column slice of a projection output is fine), "
            "weight [C, W] (tap W-1 on the current token), doc_ids [B, L] int or None -> y "
            "[B, L, C] in x.dtype = silu(causal depthwise conv) inside each document, from "
            "zeros, fp32 sums (the R mixer's q | k | v conv without a cache; a cached step runs "
            "the reference, which also returns the tail); triton saves x, weight and doc_ids "
            "and recomputes the conv in backward",
            short_conv_reference, _short_conv_inputs,
            {"check": {"batch": 2, "seq": 77, "channels": 150, "taps": 4, "doc_len": 20,
                       "pad": 9},
             "nam56r": {"batch": 8, "seq": 2048, "channels": 1024, "taps": 4, "doc_len": 512,
                        "pad": 520}},
            ("x", "weight"), None, _short_conv_bytes,
        ),
        Surface(
            "gated_delta",
            "gated delta rule, chunked: q, k [B, L, H, K], v [B, L, H, V] (same dtype), g, beta "
            "[B, L, H] (float32), reset [B, L] bool doc starts or None, initial_state "
            "[B, H, K, V] or None -> o [B, L, H, V] in q.dtype + final state [B, H, K, V] "
            "float32 (see ops/gated_delta); triton saves q, k, v, g, beta, T [B, H, L, 64], "
            "w, chunk-entry states [B, H, L/64, K, V], v_new (T, v_new bf16 for bf16 inputs, "
            "else fp32) and the decays (backward adds dL/dP [B, H, L/64, 64, 64] and a "
            "[B, H, L/64, 1 + K/BKS, 64, 64] fp32 scratch); "
            "bf16 inputs take bf16 products (T's inverse tf32); calls it cannot take (float16/float64, "
            "K > 128, CPU) run the reference",
            gated_delta_rule_chunked, _gated_delta_inputs,
            {"check": {"batch": 2, "seq": 200, "heads": 2, "head_k": 32, "head_v": 64,
                       "doc_len": 60, "final_state": 1},
             "nam56r_4k": {"batch": 8, "seq": 4096, "heads": 4, "head_k": 64, "head_v": 128},
             "nam56r_8k": {"batch": 8, "seq": 8192, "heads": 4, "head_k": 64, "head_v": 128},
             "h16_d128_4k": {"batch": 8, "seq": 4096, "heads": 16, "head_k": 128,
                             "head_v": 128}},
            ("q", "k", "v", "g", "beta"), _gated_delta_flops, _gated_delta_bytes,
        ),
        Surface(
            "muon_momentum",
            "bufs, grads: lists of float32 [*, rows, cols] (Muon's momentum buffers and the "
            "gradients), momentum, nesterov, out [sum of matrices, rows, cols] (any float "
            "dtype: the Newton-Schulz input) -> bufs = momentum * bufs + grads in place; the "
            "update (grads + momentum * bufs with Nesterov, else bufs) written into out in "
            "parameter order; optional grad_scale (one float32 on the device: the clipping "
            "coefficient) multiplies every grad first, the grads left unwritten; no autograd "
            "(an optimizer pass): checked by what it writes "
            "(tests/kernels/test_muon.py), not by kernels check",
            muon_momentum_reference,
        ),
        Surface(
            "muon_apply",
            "params: a list of float32 [*, rows, cols], ortho [sum of matrices, rows, cols] "
            "contiguous (the Newton-Schulz result, any float dtype), lr (float or a device "
            "scalar, for a captured step), weight_decay, scale -> params = params * (1 - lr * "
            "weight_decay) - scale * lr * ortho in place; no autograd (see muon_momentum)",
            muon_apply_reference,
        ),
        Surface(
            "muon_polynomial",
            "gram [batch, m, m] symmetric (Newton-Schulz's A = X X^T; bf16 on the GPU), a, b, "
            "c -> a I + b A + c A A, a new tensor in gram's dtype (symmetric); float32 "
            "accumulation; normalize_eps (NS's first step): A is X X^T of an unnormalized X, "
            "s = 1 / (sqrt(trace A) + eps), result s (a I + b s^2 A + c s^4 A A); no autograd: "
            "kernels check compares the output, kernels bench times the forward",
            muon_polynomial_reference,
            _muon_polynomial_inputs,
            # nam56r-350m's Muon batches (Gram matrices of 391 MoE w_in halves 544 x 768,
            # 391 w_out 768 x 272 (transposed: 272 x 768), 28 dense 768 x 768), in the later
            # steps' form (X already normalized)
            {"check": {"batch": 3, "m": 136, "cols": 200, "normalize": 1},
             "nam56r_moe_in": {"batch": 391, "m": 544, "cols": 768, "normalize": 0},
             "nam56r_moe_out": {"batch": 391, "m": 272, "cols": 768, "normalize": 0},
             "nam56r_dense": {"batch": 28, "m": 768, "cols": 768, "normalize": 0}},
            (), _muon_polynomial_flops, _muon_polynomial_bytes,
        ),
    ]


def _backends() -> list[Backend]:
    cuda_sm80 = {"devices": ("cuda",), "min_capability": (8, 0)}
    triton_ok = Requirements(packages=("triton",), dtypes=FLOATS, **cuda_sm80)
    triton_fp32 = Requirements(packages=("triton",), dtypes=("float32",), **cuda_sm80)
    return [
        # rmsnorm
        Backend("triton_fused", "rmsnorm", "chosen", triton_ok,
                _lazy("megacpp.kernels.ops.rmsnorm.triton", "rmsnorm_triton")),
        Backend("reference", "rmsnorm", "fallback", Requirements(), rmsnorm_reference),
        Backend("torch_compile", "rmsnorm", "donor",
                Requirements(devices=("cuda",), packages=("triton",), torch_ops=("compile",)),
                _lazy("megacpp.kernels.peers", "rmsnorm_compiled"),
                "peer: inductor's fusion of the reference; compile is applied from outside the "
                "model (train.parallelize), so it is measured, not selected"),
        # linear cross-entropy
        Backend("triton_chunked", "linear_cross_entropy", "chosen",
                Requirements(packages=("triton",), dtypes=HALF, **cuda_sm80),
                _lazy("megacpp.kernels.ops.linear_ce.triton", "linear_cross_entropy_triton")),
        Backend("reference", "linear_cross_entropy", "fallback", Requirements(),
                linear_cross_entropy_reference),
        Backend("torch_plain", "linear_cross_entropy", "donor", Requirements(),
                linear_cross_entropy_torch,
                "peer: h @ W^T then F.cross_entropy on operand-dtype logits; materialises "
                "[T, V] logits and their gradient"),
        Backend("liger", "linear_cross_entropy", "donor",
                Requirements(devices=("cuda",), packages=("liger_kernel",), dtypes=FLOATS),
                _lazy("megacpp.kernels.peers", "liger_linear_cross_entropy"),
                "peer: Liger-kernel 0.8.5 fused linear CE (fp32 accumulation); measured "
                "against, not a dependency of the training path"),
        # MoE experts
        Backend("grouped_mm", "moe_experts", "chosen",
                Requirements(devices=("cuda",), min_capability=(9, 0), packages=("triton",),
                             torch_ops=("_grouped_mm",), dtypes=("bfloat16",)),
                _lazy("megacpp.kernels.ops.moe.grouped", "moe_experts_grouped")),
        Backend("reference", "moe_experts", "fallback", Requirements(), moe_experts_reference),
        Backend("triton_grouped", "moe_experts", "deferred",
                Requirements(devices=("cuda",), packages=("triton",), dtypes=HALF), None,
                "the whole expert path in Triton for devices whose torch lacks a CUDA "
                "_grouped_mm (pre-Hopper): not written yet (grouped_mm_triton and "
                "grouped_wgrad_triton, inside the chosen backend, load through tensor "
                "descriptors: sm90+); such devices use the reference"),
        # attention
        Backend("sdpa_flash", "attention", "chosen",
                Requirements(dtypes=HALF, **cuda_sm80), causal_attention_sdpa_flash),
        Backend("reference", "attention", "fallback", Requirements(), causal_attention_reference),
        Backend("flash_attn_3", "attention", "deferred",
                Requirements(devices=("cuda",), min_capability=(9, 0), max_capability=(9, 0),
                             packages=("flash_attn_interface",), dtypes=HALF), None,
                "FlashAttention-3 (Hopper) ships no wheel for this torch/CUDA; building it from "
                "source is outside this tree"),
        Backend("flash_attn_4", "attention", "deferred",
                Requirements(devices=("cuda",), min_capability=(10, 0), dtypes=HALF), None,
                "FlashAttention-4 (CuTe DSL) targets Blackwell; not installable or testable on "
                "the Hopper machines this project measures on"),
        # document attention
        Backend("flex", "document_attention", "chosen",
                Requirements(packages=("triton",), torch_ops=("compile",), dtypes=FLOATS,
                             **cuda_sm80),
                document_attention_flex),
        Backend("reference", "document_attention", "fallback", Requirements(),
                document_attention_reference),
        # Mamba-3 scan
        Backend("triton_chunked", "mamba3_scan", "chosen",
                Requirements(packages=("triton",), dtypes=FLOATS, **cuda_sm80),
                _lazy("megacpp.kernels.ops.mamba3_scan.triton", "mamba3_scan_triton")),
        Backend("reference", "mamba3_scan", "fallback", Requirements(), mamba3_scan_chunked),
        Backend("mamba_ssm", "mamba3_scan", "donor",
                Requirements(devices=("cuda",), min_capability=(8, 0), packages=("mamba_ssm",),
                             dtypes=("bfloat16",)),
                _lazy("megacpp.kernels.peers", "mamba3_siso_combined"),
                "peer: mamba_ssm 2.3.2's mamba3_siso_combined (Triton, bf16), called through an "
                "adapter from this surface's layout (no packed documents: its varlen form did not "
                "match this surface); the speed bar for our Triton scan, not a dependency of the "
                "training path"),
        Backend("tilelang_mimo", "mamba3_scan", "deferred",
                Requirements(devices=("cuda",), packages=("tilelang",)), None,
                "TileLang MIMO variant: tilelang is not installable here and the model uses SISO"),
        # short conv
        Backend("triton", "short_conv", "chosen", triton_ok,
                _lazy("megacpp.kernels.ops.short_conv.triton", "short_conv_triton")),
        Backend("reference", "short_conv", "fallback", Requirements(), short_conv_reference),
        Backend("torch_compile", "short_conv", "donor",
                Requirements(devices=("cuda",), packages=("triton",), torch_ops=("compile",)),
                _lazy("megacpp.kernels.peers", "short_conv_compiled"),
                "peer: inductor's fusion of the reference, which a compiled model ran before "
                "the Triton kernel; measured, not selected"),
        # gated delta rule
        Backend("triton_chunked", "gated_delta", "chosen",
                Requirements(packages=("triton",), dtypes=("float32", "bfloat16"), **cuda_sm80),
                _lazy("megacpp.kernels.ops.gated_delta.triton", "gated_delta_rule_triton")),
        Backend("reference", "gated_delta", "fallback", Requirements(), gated_delta_rule_chunked),
        Backend("fla", "gated_delta", "donor",
                Requirements(devices=("cuda",), min_capability=(8, 0), packages=("fla",),
                             dtypes=HALF), _lazy("megacpp.kernels.peers", "fla_chunk_gated_delta_rule"),
                "peer: flash-linear-attention 0.6.0 (fla-core) chunk_gated_delta_rule, doc resets "
                "as cu_seqlens; the speed bar for our Triton kernel, not on the training path",
                check_guard=fla_check_guard),
        # Muon's elementwise passes (the optimizer, not the model)
        Backend("triton_multi_tensor", "muon_momentum", "chosen", triton_fp32,
                _lazy("megacpp.kernels.ops.muon.triton", "muon_momentum_triton")),
        Backend("reference", "muon_momentum", "fallback", Requirements(),
                muon_momentum_reference),
        Backend("triton_multi_tensor", "muon_apply", "chosen", triton_fp32,
                _lazy("megacpp.kernels.ops.muon.triton", "muon_apply_triton")),
        Backend("reference", "muon_apply", "fallback", Requirements(), muon_apply_reference),
        Backend("triton_symmetric", "muon_polynomial", "chosen",
                Requirements(devices=("cuda",), min_capability=(9, 0), packages=("triton",),
                             dtypes=HALF),
                _lazy("megacpp.kernels.ops.muon.triton", "muon_polynomial_triton")),
        Backend("reference", "muon_polynomial", "fallback", Requirements(),
                muon_polynomial_reference),
    ]


@functools.cache
def default_catalog() -> Catalog:
    """The catalog of this tree (built once)."""
    catalog = Catalog()
    for surface in _surfaces():
        catalog.add_surface(surface)
    for backend in _backends():
        catalog.add(backend)
    return catalog
