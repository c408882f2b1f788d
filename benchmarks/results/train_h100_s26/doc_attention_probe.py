"""Device probe: attention over packed rows at the nam56r-350m step's shape (B 8, 12 query
heads, 2 KV heads, L 2048, head_dim 64, bf16), forward + backward as CUDA-graph replays, with
the document ids of the session's dataset (libstdc++ headers, the trainer's first batches):

* "sdpa_mask": SDPA with the dense [B, 1, L, L] document-causal mask (what the model runs for
  packed rows today: cuDNN's masked kernel over every block);
* "sdpa_causal": SDPA causal, no document mask (the training-step benchmark's path; wrong for
  packed rows, there for speed);
* "flex_doc": torch's FlexAttention (compiled) with a document-causal block mask made outside
  the timed work; "flex_doc_mask_inside": the block mask made from doc_ids inside it (as the
  model would, each step).

Prints and writes OUT.json: ms per fwd+bwd (median of 20 replays), and each variant's largest
difference from "sdpa_mask" in the output and the three gradients (relative to that tensor's
largest value), plus a bench receipt.

    PYTHONPATH=src python benchmarks/results/train_h100_s26/doc_attention_probe.py DATASET OUT.json
"""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from megacpp.data.loader import PackedLoader
from megacpp.kernels import timing
from megacpp.model.attention import document_causal_mask
from megacpp.receipts import write_receipt

B, H, HKV, L, HD = 8, 12, 2, 2048, 64
flex = torch.compile(flex_attention, dynamic=False)


def block_mask_of(doc_ids):
    def doc_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])
    return create_block_mask(doc_causal, B, None, L, L, device=doc_ids.device)


def main() -> None:
    dataset, out = sys.argv[1], Path(sys.argv[2])
    dev = torch.device("cuda")
    batch = next(iter(PackedLoader(dataset, batch_size=B, seed=0)))
    doc_ids = batch["doc_ids"].to(dev)
    docs = [int(torch.unique(r).numel()) for r in doc_ids]
    gen = torch.Generator(device=dev).manual_seed(0)
    inputs = {name: torch.randn(B, h, L, HD, device=dev, generator=gen, dtype=torch.bfloat16)
              .requires_grad_() for name, h in (("q", H), ("k", HKV), ("v", HKV))}
    mask = document_causal_mask(doc_ids)[:, None]
    fixed_block_mask = block_mask_of(doc_ids)
    variants = {
        "sdpa_mask": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                    enable_gqa=True),
        "sdpa_causal": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                      enable_gqa=True),
        "flex_doc": lambda q, k, v: flex(q, k, v, block_mask=fixed_block_mask, enable_gqa=True),
        "flex_doc_mask_inside": lambda q, k, v: flex(q, k, v, block_mask=block_mask_of(doc_ids),
                                                     enable_gqa=True),
    }
    cot = torch.randn(B, H, L, HD, device=dev, generator=gen, dtype=torch.bfloat16)

    def outputs(fn):
        leaves = {n: t.detach().requires_grad_() for n, t in inputs.items()}
        y = fn(**leaves)
        grads = torch.autograd.grad(y, list(leaves.values()), cot)
        return [y.detach(), *grads]

    truth = outputs(variants["sdpa_mask"])
    rows = {}
    for name, fn in variants.items():
        row = {}
        try:
            got = outputs(fn)
            row["max_rel_diff_vs_sdpa_mask"] = {
                what: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                for what, a, b in zip(("out", "dq", "dk", "dv"), got, truth, strict=True)}
            graphed = timing.time_fwd_bwd_graphed(fn, inputs, ("q", "k", "v"), dev,
                                                  repeats=20)
            row["replay_ms"] = graphed.median_ms
            row["capture_failure"] = graphed.failure
            row["per_call_ms"] = timing.time_fwd_bwd(fn, inputs, ("q", "k", "v"), dev).median_ms
        except (RuntimeError, ValueError, TypeError, AssertionError) as exc:  # a result, not a stop
            row["error"] = timing.describe_error(exc)
        rows[name] = row
        print(name, json.dumps(row), flush=True)
    result = {"device": torch.cuda.get_device_name(), "docs_per_row": docs,
              "shape": {"B": B, "H": H, "Hkv": HKV, "L": L, "head_dim": HD}, "rows": rows}
    out.write_text(json.dumps(result, indent=1))
    metrics = {f"{n}_replay_ms": r["replay_ms"] for n, r in rows.items()
               if r.get("replay_ms") is not None}
    write_receipt(out.with_suffix(".receipt.json"), "bench",
                  {"script": "benchmarks/results/train_h100_s26/doc_attention_probe.py",
                   "dtype": "bfloat16", "shape": result["shape"], "docs_per_row": docs},
                  metrics, [out])


if __name__ == "__main__":
    main()
