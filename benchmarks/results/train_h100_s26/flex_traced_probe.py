"""Device probe: is FlexAttention over document_block_mask right when torch.compile traces it
(as a compiled block would), forward and backward? Call 7's trainer, with the backend traced
into its compiled blocks, had gradient norms of 1e9-1e18 from step 1 (20-40 otherwise).
Compares, against the float64 dense-mask reference (relative Frobenius error of out, dq, dk,
dv; bf16 and float32): the eager call (compiled flex, mask made eagerly), and compiled
functions that make the mask inside (traced) or take it made outside, with grouped-query heads
or with k / v expanded to every head. Call 8 ran it with the mask's kv order from a stable
sort of the flags, call 9 with the scatter that replaced it. Writes OUT.json.

    PYTHONPATH=src python benchmarks/results/train_h100_s26/flex_traced_probe.py OUT.json
"""

import json
import sys
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import flex_attention

from megacpp.kernels.ops.attention.document import (
    document_attention_flex,
    document_attention_reference,
    document_block_mask,
)


def ids(lengths):
    return torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)])
                        for row in lengths]).cuda()


def main() -> None:
    out = Path(sys.argv[1])
    doc_ids = ids([[700, 1, 299, 1048], [2048]])
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(2, 6, 2048, 64, device="cuda", generator=gen)
    k, v = (torch.randn(2, 2, 2048, 64, device="cuda", generator=gen) for _ in range(2))
    cot = torch.randn(2, 6, 2048, 64, device="cuda", generator=gen)

    def traced_inside(q, k, v, d):
        return flex_attention(q, k, v, block_mask=document_block_mask(d), enable_gqa=True)

    def traced_expanded(q, k, v, d):
        rep = q.shape[1] // k.shape[1]
        return flex_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                              block_mask=document_block_mask(d))

    mask = document_block_mask(doc_ids)
    compiled_outside = torch.compile(
        lambda q, k, v, d: flex_attention(q, k, v, block_mask=mask, enable_gqa=True))
    variants = {
        "eager_call": document_attention_flex,
        "traced_mask_inside": torch.compile(traced_inside),
        "traced_mask_inside_expanded_kv": torch.compile(traced_expanded),
        "traced_mask_outside": compiled_outside,
    }

    def run(fn, dt):
        leaves = [t.to(dt).requires_grad_() for t in (q, k, v)]
        y = fn(*leaves, doc_ids)
        return [y, *torch.autograd.grad(y, leaves, cot.to(dt))]

    truth = run(document_attention_reference, torch.float64)
    rows = {}
    for dt in (torch.bfloat16, torch.float32):
        for name, fn in variants.items():
            key = f"{name}/{str(dt)[6:]}"
            try:
                got = run(fn, dt)
                rows[key] = {w: ((g.double() - r).norm() / r.norm()).item()
                             for w, g, r in zip(("out", "dq", "dk", "dv"), got, truth, strict=True)}
            except (RuntimeError, ValueError, TypeError, AssertionError) as exc:
                rows[key] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            print(key, json.dumps(rows[key]), flush=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                               "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
