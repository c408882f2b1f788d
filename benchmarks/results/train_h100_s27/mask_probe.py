"""Device probe: why session 26's document block mask was wrong when torch.compile traced its
construction on the GPU (train_h100_s26, call 8), and whether this tree's mask is right.

1. Inductor's sort alone: the kv order session 26 used (a stable descending sort of int8 keep
   flags) and this tree's (an argsort of keys unique per block), compiled against eager on the
   flags of the probe's document layout: equal indices, and whether the compiled order still
   puts exactly the kept blocks first (a valid order for FlexAttention).
2. The whole BlockMask, session 26's construction (transcribed below) and this tree's
   (``document_block_mask``): each of its eight tensors, traced against eager.

Writes OUT.json; prints one line per comparison.

    PYTHONPATH=src python benchmarks/results/train_h100_s27/mask_probe.py OUT.json
"""

import json
import sys
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import BlockMask

from megacpp.kernels.ops.attention import document
from megacpp.kernels.ops.attention.document import BLOCK, _block_ranges, document_block_mask

FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def ids(lengths, device):
    return torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)])
                        for row in lengths]).to(device)


def session26_mask(doc_ids):
    """document_block_mask as of 3929c77: the kv order from a stable sort of int8 flags."""
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
        order = torch.sort(keep.to(torch.int8), dim=-1, descending=True, stable=True).indices
        return keep.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]

    kv_num, kv_idx = indexed(partial)
    full_num, full_idx = indexed(full)
    last = length - 1

    def mask_mod(b, h, q_idx, kv_idx):
        same = doc_ids[b, q_idx.clamp(max=last)] == doc_ids[b, kv_idx.clamp(max=last)]
        return (kv_idx <= q_idx) & same

    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK,
                                    mask_mod=mask_mod, seq_lengths=(length, length))


def sort_int8(keep):
    return torch.sort(keep.to(torch.int8), dim=-1, descending=True, stable=True).indices


def argsort_unique(keep):
    nb = keep.shape[-1]
    blk = torch.arange(nb, device=keep.device)
    return torch.where(keep, blk, blk + nb).argsort(dim=-1)


def kept_first(order, keep):
    """Whether the first keep.sum() entries of each row of ``order`` are exactly its kept
    blocks (any order among them)."""
    num = keep.sum(-1, keepdim=True)
    pos = torch.arange(keep.shape[-1], device=keep.device)
    return bool((keep.gather(-1, order) == (pos < num)).all())


def compare(a, b):
    if torch.equal(a, b):
        return "equal"
    return f"DIFFERENT ({(a != b).sum().item()} of {a.numel()} entries)"


def main() -> None:
    out = Path(sys.argv[1])
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a dry run of the probe
    doc_ids = ids([[700, 1, 299, 1048], [2048]], device)
    rows = {}
    # 1. the sort alone, on the partial-tile flags of this layout and on random flags
    lo, hi = _block_ranges(doc_ids, doc_ids.shape[1])
    blk = torch.arange(lo.shape[1], device=device)
    partial = ((hi[:, None, :] >= lo[:, :, None]) & (lo[:, None, :] <= hi[:, :, None])
               & (blk[None, None, :] <= blk[None, :, None]))
    gen = torch.Generator(device=device).manual_seed(0)
    random_flags = torch.rand(8, 16, 16, device=device, generator=gen) < 0.4
    for flags_name, keep in (("layout", partial), ("random", random_flags)):
        for name, fn in (("sort_int8_stable", sort_int8), ("argsort_unique_keys", argsort_unique)):
            eager, traced = fn(keep), torch.compile(fn, fullgraph=True)(keep)
            key = f"sort/{name}/{flags_name}"
            rows[key] = {"traced_vs_eager": compare(eager, traced),
                         "eager_kept_first": kept_first(eager, keep),
                         "traced_kept_first": kept_first(traced, keep)}
            print(key, json.dumps(rows[key]), flush=True)
    # 2. the whole mask
    for name, make in (("session26", session26_mask), ("this_tree", document_block_mask)):
        def fields(d, make=make):
            mask = make(d)
            return tuple(getattr(mask, f) for f in FIELDS)

        eager, traced = fields(doc_ids), torch.compile(fields)(doc_ids)
        key = f"mask/{name}"
        rows[key] = {f: compare(e, t) for f, e, t in zip(FIELDS, eager, traced, strict=True)}
        print(key, json.dumps(rows[key]), flush=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                               "torch": torch.__version__,
                               "document_module": document.__file__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
