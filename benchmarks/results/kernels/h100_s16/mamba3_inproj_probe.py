"""Mamba-3 in_proj probe (dev record, session 16): one compiled Mamba-3 mixer at the
nam56r-350m step's shape (B 8, L 2048, d_model 768, 24 heads of 64, d_state 64), forward +
backward as a CUDA graph under bf16 autocast, with in_proj computed three ways in one process:

  split: one [3288, 768] GEMM, split into z, x, B, C, dd_dt, dd_A, trap, angles (the model at
         f798d5d): its backward concatenates the eight gradients into one [T, 3288] tensor;
  zx+rest: two GEMMs (z and x together, the rest), each split;
  z+x+rest: three GEMMs over row slices of the same weight: the input's gradient is the sum
         of three [T, 768] products instead of a GEMM on a concatenated [T, 3288] gradient.

    PYTHONPATH=$PWD/src:$PWD python benchmarks/results/kernels/h100_s16/mamba3_inproj_probe.py OUT
"""

import json
import statistics
import sys

import torch
import torch.nn.functional as F

from megacpp.kernels.runtime import set_kernel_mode
from megacpp.kernels.timing import capture_graph, cuda_times_ms
from megacpp.model.mamba3 import Mamba3Mixer


def split(m, x):
    return m.in_proj(x).split(m._split, dim=-1)


def zx_rest(m, x):
    w, d = m.in_proj.weight, m.d_inner
    return (*F.linear(x, w[: 2 * d]).split([d, d], -1),
            *F.linear(x, w[2 * d:]).split(m._split[2:], -1))


def z_x_rest(m, x):
    w, d = m.in_proj.weight, m.d_inner
    return (F.linear(x, w[:d]), F.linear(x, w[d: 2 * d]),
            *F.linear(x, w[2 * d:]).split(m._split[2:], -1))


VARIANTS = {"split": split, "zx+rest": zx_rest, "z+x+rest": z_x_rest}


def main(out: str) -> None:
    set_kernel_mode("fast")
    torch.manual_seed(0)
    rows = []
    x = torch.randn(8, 2048, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(8, 2048, 768, device="cuda", dtype=torch.bfloat16)
    for rep in range(2):
        for name, project in VARIANTS.items():
            torch._dynamo.reset()
            torch.manual_seed(0)
            m = Mamba3Mixer(768, d_state=64, headdim=64, expand=2, ngroups=1, chunk_size=64,
                            rope_fraction=0.5).cuda()
            m._project = lambda t, m=m, f=project: f(m, t)
            fn = torch.compile(m)

            def step(fn=fn):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    y = fn(x)
                y.backward(dy)

            step()  # one call from zero grads: the variants must agree on them
            grads = [x.grad.float().norm().item(), m.in_proj.weight.grad.float().norm().item()]
            x.grad = None
            graph, _ = capture_graph(step)
            ms = statistics.median(cuda_times_ms(graph.replay, warmup=3, iters=30))
            rows.append({"variant": name, "rep": rep, "fwd_bwd_ms": ms, "grad_norms": grads})
            print(json.dumps(rows[-1]), flush=True)
            x.grad = None
            del graph, m
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
