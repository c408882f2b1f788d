"""Device probe (session 30): FlexAttention's mask-shape flags on the document attention.

The kept launch setting (``HOPPER_D64_OPTIONS``, session 29) plus flags that only tell the
kernels what the mask guarantees, so outputs should not change: ``ROWS_GUARANTEED_SAFE``
(every query row keeps at least one key: a causal document mask always keeps the diagonal)
and ``BLOCKS_ARE_CONTIGUOUS`` (each query block's key blocks form one run: from its
document's first block to the diagonal). Times forward and forward+backward as CUDA-graph
replays at the nam56r step's shape (B 8, H 12 / 2, L 2048, Dh 64) with 2 and 8 documents a
row, two rounds, and compares each variant's output and gradients with the kept setting's
(bit for bit) and with the float32 masked-SDPA reference (largest difference over the largest
value, per tensor: rounding, or a wrong block visited).

    PYTHONPATH=src python benchmarks/results/kernels/h100_s30/flex_flags.py OUT.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import flex_attention

from megacpp.kernels.ops.attention.document import (
    HOPPER_D64_OPTIONS,
    document_attention_reference,
    document_block_mask,
)
from megacpp.kernels.registry import _document_attention_inputs
from megacpp.kernels.timing import capture_graph, cuda_times_ms, time_fwd_bwd_graphed

ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 2
VARIANTS = {
    "kept": {},
    "+ROWS_GUARANTEED_SAFE": {"ROWS_GUARANTEED_SAFE": True},
    "+BLOCKS_ARE_CONTIGUOUS": {"BLOCKS_ARE_CONTIGUOUS": True},
    "+both": {"ROWS_GUARANTEED_SAFE": True, "BLOCKS_ARE_CONTIGUOUS": True},
}


def main() -> None:
    out = Path(sys.argv[1])
    torch._dynamo.config.recompile_limit = 256
    device = torch.device("cuda")
    compiled = torch.compile(flex_attention, dynamic=False)
    rows = []
    for docs in (2, 8):
        case = {"batch": 8, "heads": 12, "kv_heads": 2, "seq": 2048, "head_dim": 64,
                "docs": docs}
        inp = _document_attention_inputs(case, torch.bfloat16, device,
                                         torch.Generator(device=device).manual_seed(0))
        for t in ("q", "k", "v"):
            inp[t].requires_grad_(True)
        mask = document_block_mask(inp["doc_ids"])
        cot = torch.randn_like(inp["q"])

        def make(flags, mask=mask):
            opts = {**HOPPER_D64_OPTIONS, **flags}

            def fn(q, k, v, doc_ids):
                return compiled(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=opts)
            return fn

        def outputs(fn, inp=inp, cot=cot):
            o = fn(**inp)
            grads = torch.autograd.grad(o, [inp["q"], inp["k"], inp["v"]], cot)
            return [o.detach(), *grads]

        want = outputs(make({}))
        leaves = {t: inp[t].detach().float().requires_grad_(True) for t in ("q", "k", "v")}
        ref_out = document_attention_reference(**leaves, doc_ids=inp["doc_ids"])
        truth = [ref_out.detach(), *torch.autograd.grad(ref_out, list(leaves.values()),
                                                         cot.float())]
        for round_ in range(ROUNDS):
            for name, flags in VARIANTS.items():
                fn = make(flags)
                got = outputs(fn)
                same = all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
                err = [float((g.float() - t).abs().max() / t.abs().max())
                       for g, t in zip(got, truth, strict=True)]
                graph, _ = capture_graph(lambda fn=fn, inp=inp: fn(**inp), warmup=2)
                fwd = statistics.median(cuda_times_ms(graph.replay, iters=20))
                both = time_fwd_bwd_graphed(fn, inp, ("q", "k", "v"), device, repeats=20)
                rows.append({"docs": docs, "round": round_, "variant": name, "flags": flags,
                             "fwd_replay_ms": fwd, "fwd_bwd_replay_ms": both.median_ms,
                             "bit_equal_to_kept": same, "max_rel_err_o_dq_dk_dv": err})
                print(f"docs {docs} round {round_} {name:24s} fwd {fwd:6.3f} ms  fwd+bwd "
                      f"{both.median_ms:6.3f} ms  bit-equal {same}  err vs fp32 reference "
                      f"{' '.join(f'{e:.1e}' for e in err)}", flush=True)
                out.write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
