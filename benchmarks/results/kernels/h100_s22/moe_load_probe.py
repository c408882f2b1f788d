"""The MoE's per-expert load under torch.compile (session 22): on the host of calls 4 and 5 the
profiled step spent 606 us per MoE layer (13.9 ms per step) in the one Inductor kernel that
computes it (``triton_red_fused__unsafe_view_add_arange_clone_copy__eq_sum_0``: the one-hot
column sum of e122c7e with the buffer updates fused in), which other hosts' steps did not show.
This times the module's own statement and alternatives, each compiled the way the step
compiles them, with the buffer updates: one-hot column sum (the tree), the same over 64 row
chunks then summed, index_add of ones (session 20's), and the plan's group ends (diff of the
counting sort's offsets). 16384 tokens, top-2 of 16 experts; 200 calls between two CUDA
events, median of 5.

    PYTHONPATH=$PWD/src python benchmarks/results/kernels/h100_s22/moe_load_probe.py OUT.json
"""

import json
import statistics
import sys

import torch

from megacpp.kernels.ops.moe.grouped import dispatch_plan

E = 16


def onehot(idx):
    return (idx.reshape(-1, 1) == torch.arange(E, device=idx.device)).sum(0, dtype=torch.float32)


def chunked(idx):
    hits = idx.reshape(64, -1, 1) == torch.arange(E, device=idx.device)
    return hits.sum(1, dtype=torch.float32).sum(0)


def index_add(idx):
    ones = torch.ones(idx.numel(), device=idx.device)
    return torch.zeros(E, device=idx.device).index_add_(0, idx.reshape(-1), ones)


def plan_offs(idx):
    offs = dispatch_plan(idx, E).offs
    return torch.diff(offs, prepend=offs.new_zeros(1)).float()


def with_buffers(load_fn):
    def step(idx, last, routed):
        load = load_fn(idx)
        last.copy_(load)
        routed += load
    return step


def timed_us(fn) -> float:
    for _ in range(10):
        fn()
    runs = []
    for _ in range(5):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(200):
            fn()
        end.record()
        torch.cuda.synchronize()
        runs.append(begin.elapsed_time(end) / 200 * 1e3)
    return statistics.median(runs)


def main() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    idx = torch.randn(16384, E, device=dev, generator=gen).topk(2, dim=-1).indices
    want = torch.bincount(idx.reshape(-1), minlength=E).float()
    rows = []
    for name, fn in (("onehot", onehot), ("chunked", chunked), ("index_add", index_add),
                     ("plan_offs", plan_offs)):
        last, routed = torch.zeros(E, device=dev), torch.zeros(E, device=dev)
        compiled = torch.compile(with_buffers(fn), fullgraph=name != "plan_offs")
        compiled(idx, last, routed)
        assert torch.equal(last, want), name
        us = timed_us(lambda c=compiled, a=last, b=routed: c(idx, a, b))
        rows.append({"load": name, "us": round(us, 2)})
        print(json.dumps(rows[-1]), flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
