"""Device probe: which construction of the document block mask stays right when torch.compile
traces it together with FlexAttention (call 1: the mask's eight tensors come out equal to
eager when returned from the compiled function, yet the attention over them is 9% off).

Variants, each a compiled function that makes the mask from doc_ids and attends over it,
bf16, against the float64 dense-mask reference (relative Frobenius error of out per batch row,
and of dq, dk, dv; with ``--no-grad``, of out per row from a forward under torch.no_grad):
  - ``unsqueezed``: call 1's tree (counts and indices computed [B, NB(, NB)], the head axis
    added by a view ``[:, None]``);
  - ``four_d``: call 2's tree (every tensor [B, 1, ...] from the start, int32 and contiguous as
    torch's own ``_dense_to_ordered`` makes them), transcribed below;
  - ``torch_create_block_mask``: torch's ``create_block_mask`` traced in the same function;
  - ``made_opaque``: call 1's mask made in a ``torch.compiler.disable`` helper (a graph break);
  - ``operator``: this tree's ``document_block_mask`` (its tensors from one custom operator,
    ``document_block_tiles``, opaque to torch.compile without a graph break; call 3 on).

With ``--only NAME`` runs one variant (for TORCH_LOGS=output_code, to read the strides the
generated kernel is given). Writes OUT.json.

    PYTHONPATH=src python benchmarks/results/train_h100_s27/flex_layout_probe.py OUT.json
"""

import argparse
import json
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from megacpp.kernels.ops.attention.document import (
    BLOCK,
    _block_ranges,
    document_attention_reference,
    document_block_mask,
)


def unsqueezed_mask(doc_ids):
    """document_block_mask as run in call 1 (the head axis a view of [B, NB] results)."""
    length = doc_ids.shape[1]
    lo, hi = _block_ranges(doc_ids, length)
    nb = lo.shape[1]
    blk = torch.arange(nb, device=doc_ids.device)
    q_lo, q_hi, k_lo, k_hi = lo[:, :, None], hi[:, :, None], lo[:, None, :], hi[:, None, :]
    below = blk[None, :, None] > blk[None, None, :]
    meets = (k_hi >= q_lo) & (k_lo <= q_hi) & (blk[None, None, :] <= blk[None, :, None])
    whole = blk < length // BLOCK
    full = (below & whole[None, :, None] & whole[None, None, :]
            & (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo))
    partial = meets & ~full

    def indexed(keep):
        order = torch.where(keep, blk, blk + nb).argsort(dim=-1)
        return keep.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]

    kv_num, kv_idx = indexed(partial)
    full_num, full_idx = indexed(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK,
                                    mask_mod=_mask_mod(doc_ids), seq_lengths=(length, length))


def four_d_mask(doc_ids):
    """document_block_mask as run in call 2 (the head axis present from the start)."""
    length = doc_ids.shape[1]
    lo, hi = _block_ranges(doc_ids, length)
    nb = lo.shape[1]
    q_lo, q_hi = lo[:, None, :, None], hi[:, None, :, None]
    k_lo, k_hi = lo[:, None, None, :], hi[:, None, None, :]
    q_blk = torch.arange(nb, device=doc_ids.device)[:, None]
    k_blk = torch.arange(nb, device=doc_ids.device)[None, :]
    whole = length // BLOCK
    meets = (k_hi >= q_lo) & (k_lo <= q_hi) & (k_blk <= q_blk)
    full = ((k_blk < q_blk) & (q_blk < whole) & (q_lo == q_hi) & (k_lo == k_hi)
            & (q_lo == k_lo))
    partial = meets & ~full

    def indexed(keep):
        order = torch.where(keep, k_blk, k_blk + nb).argsort(dim=-1)
        return (keep.sum(-1, dtype=torch.int32).contiguous(),
                order.to(torch.int32, memory_format=torch.contiguous_format))

    kv_num, kv_idx = indexed(partial)
    full_num, full_idx = indexed(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK,
                                    mask_mod=_mask_mod(doc_ids), seq_lengths=(length, length))


def _mask_mod(doc_ids):
    last = doc_ids.shape[1] - 1

    def mask_mod(b, h, q_idx, kv_idx):
        same = doc_ids[b, q_idx.clamp(max=last)] == doc_ids[b, kv_idx.clamp(max=last)]
        return (kv_idx <= q_idx) & same
    return mask_mod


def torch_mask(doc_ids):
    length = doc_ids.shape[1]
    return create_block_mask(_mask_mod(doc_ids), doc_ids.shape[0], None, length, length,
                             device=doc_ids.device)


opaque_mask = torch.compiler.disable(unsqueezed_mask)

VARIANTS = {"unsqueezed": unsqueezed_mask, "four_d": four_d_mask,
            "torch_create_block_mask": torch_mask, "made_opaque": opaque_mask,
            "operator": document_block_mask}


def ids(lengths):
    return torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)])
                        for row in lengths]).cuda()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--only", choices=list(VARIANTS))
    parser.add_argument("--no-grad", action="store_true", help="the no-grad forward only")
    args = parser.parse_args()
    doc_ids = ids([[700, 1, 299, 1048], [2048]])
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(2, 6, 2048, 64, device="cuda", generator=gen)
    k, v = (torch.randn(2, 2, 2048, 64, device="cuda", generator=gen) for _ in range(2))
    cot = torch.randn(2, 6, 2048, 64, device="cuda", generator=gen)

    def run(fn, dt):
        leaves = [t.to(dt).requires_grad_() for t in (q, k, v)]
        y = fn(*leaves, doc_ids)
        return [y, *torch.autograd.grad(y, leaves, cot.to(dt))]

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    truth = run(document_attention_reference, torch.float64)
    rows = {}
    for name, make in VARIANTS.items():
        if args.only and name != args.only:
            continue

        def attend(q, k, v, d, make=make):
            return flex_attention(q, k, v, block_mask=make(d), enable_gqa=True)
        try:
            if args.no_grad:
                with torch.no_grad():
                    out = torch.compile(attend)(*(t.bfloat16() for t in (q, k, v)), doc_ids)
                rows[name] = {f"no_grad_out_row{b}": rel(out[b], truth[0][b]) for b in range(2)}
            else:
                got = run(torch.compile(attend), torch.bfloat16)
                rows[name] = {f"out_row{b}": rel(got[0][b], truth[0][b]) for b in range(2)}
                rows[name].update({w: rel(g, r) for w, g, r in
                                   zip(("dq", "dk", "dv"), got[1:], truth[1:], strict=True)})
        except (RuntimeError, ValueError, TypeError, AssertionError) as exc:  # a result too
            rows[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
        print(name, json.dumps(rows[name]), flush=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                    "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
