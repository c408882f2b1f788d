"""Session 29 probe: FlashAttention's variable-length kernels (aten ``_flash_attention_forward``
/ ``_backward`` with cumulative sequence offsets) for the document attention of packed rows,
against the chosen flex row and the causal flash kernel with no documents (the floor).

The documents become the sequences: cu_seqlens from doc_ids on the device with no host sync,
padded to a static number of sequences ``n_max`` with empty ones (offset T), so the grid is
static and the call can be captured. Every empty sequence still launches its programs, so the
probe times several ``n_max``. Forward+backward, per call and CUDA-graph replays, at the step's
shape (B 8, H 12 / 2, L 2048, Dh 64) with 2 and 8 documents per row; the outputs are checked
against the flex row's.

usage: python3 varlen_probe.py OUT_JSON
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from megacpp.kernels.ops.attention.document import document_attention_flex
from megacpp.kernels.registry import _document_attention_inputs
from megacpp.kernels.timing import time_fwd_bwd, time_fwd_bwd_graphed


def cu_seqlens(doc_ids: torch.Tensor, n_max: int) -> torch.Tensor:
    """[B, L] ids -> [n_max + 1] int32 starts of the row segments (then T), no sync."""
    b, length = doc_ids.shape
    t = b * length
    flat = (doc_ids + torch.arange(b, device=doc_ids.device)[:, None] * (length + 1)).reshape(-1)
    start = torch.ones(t, dtype=torch.bool, device=doc_ids.device)
    start[1:] = flat[1:] != flat[:-1]
    pos = torch.where(start, torch.arange(t, device=doc_ids.device), t)
    return pos.sort().values[: n_max + 1].to(torch.int32)


class _Varlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, max_len):
        out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_len, max_len, 0.0, True, False)
        ctx.save_for_backward(q, k, v, out, lse, cu, seed, offset)
        ctx.max_len = max_len
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu, seed, offset = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q, k, v, out, lse, cu, cu, ctx.max_len, ctx.max_len, 0.0, True,
            seed, offset)
        return dq, dk, dv, None, None


def varlen_fn(n_max_per_row: int):
    def fn(q, k, v, doc_ids):
        b, h, length, d = q.shape
        cu = cu_seqlens(doc_ids, b * n_max_per_row)
        tq = q.transpose(1, 2).reshape(b * length, h, d)
        tk = k.transpose(1, 2).reshape(b * length, k.shape[1], d)
        tv = v.transpose(1, 2).reshape(b * length, v.shape[1], d)
        out = _Varlen.apply(tq, tk, tv, cu, length)
        return out.view(b, length, h, d).transpose(1, 2)
    return fn


def causal_flash(q, k, v, doc_ids):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    device = torch.device("cuda")
    rows = []
    for docs in (2, 8):
        case = {"batch": 8, "heads": 12, "kv_heads": 2, "seq": 2048, "head_dim": 64,
                "docs": docs}
        gen = torch.Generator(device=device).manual_seed(0)
        inp = _document_attention_inputs(case, torch.bfloat16, device, gen)
        for t in ("q", "k", "v"):
            inp[t].requires_grad_(True)
        want = document_attention_flex(**inp).float()
        fns = {"flex (chosen)": document_attention_flex, "causal flash, no documents": causal_flash}
        for n in (docs, 16, 64, 256):
            fns[f"varlen, n_max {n}/row"] = varlen_fn(n)
        for name, fn in fns.items():
            err = None
            if name.startswith("varlen"):
                got = fn(**inp).float()
                err = float((got - want).abs().max() / want.abs().max())
            call = time_fwd_bwd(fn, inp, ("q", "k", "v"), device, repeats=20).median_ms
            replay = time_fwd_bwd_graphed(fn, inp, ("q", "k", "v"), device, repeats=20)
            rows.append({"docs_per_row": docs, "backend": name, "per_call_ms": call,
                         "replay_ms": replay.median_ms, "capture_failure": replay.failure,
                         "max_rel_err_vs_flex": err})
            r = rows[-1]
            print(f"docs {docs}  {name:30s} per call {call:7.3f} ms  replay "
                  f"{(r['replay_ms'] or float('nan')):7.3f} ms  err {err}", flush=True)
    args.out.write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
