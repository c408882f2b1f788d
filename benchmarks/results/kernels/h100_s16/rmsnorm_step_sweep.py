"""RMSNorm launch sweep at the nam56r-350m step's pre-norm (dev record, session 16): 16384 rows
of d_model 768, a float32 stream x plus a bf16 mixer output as the residual, y in bf16, h routed
through the op (skip) -- the kernels' launch settings were swept at 1024 columns in session 14.
Times the forward alone and forward+backward as CUDA-graph replays, per setting, one process.

    PYTHONPATH=$PWD/src:$PWD python benchmarks/results/kernels/h100_s16/rmsnorm_step_sweep.py OUT [D]

(D: the row width, 768 by default; run 6 swept 768 at 77c02ff.)
"""

import itertools
import json
import statistics
import sys

import torch

from megacpp.kernels.ops.rmsnorm import triton as K
from megacpp.kernels.timing import capture_graph, cuda_times_ms

T, D = 16384, int(sys.argv[2]) if len(sys.argv) > 2 else 768
DEFAULT = (K.FWD_ROWS, K.BWD_TILE, K.BWD_PROGRAMS_PER_SM, K._block(D)[1])


def replay_us(fn) -> float:
    graph, _ = capture_graph(fn)
    return statistics.median(cuda_times_ms(graph.replay, warmup=3, iters=30)) * 1e3


def main(out: str) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, D, device="cuda", generator=g).requires_grad_()
    r = torch.randn(T, D, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).requires_grad_()
    dy = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    dy2 = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    ds = torch.randn(T, D, device="cuda", generator=g)
    block = K._block(D)[0]

    def fwd():
        with torch.no_grad():
            K.rmsnorm_triton(x, w, r, 1e-5, torch.bfloat16, True)

    def fwd_bwd(fanout):
        outs = K.rmsnorm_triton(x, w, r, 1e-5, torch.bfloat16, True, fanout)
        torch.autograd.backward(outs, [dy, dy2, ds] if fanout == 2 else [dy, ds])

    rows = []

    def setting(fwd_rows, tile, per_sm, warps):
        K.FWD_ROWS, K.BWD_TILE, K.BWD_PROGRAMS_PER_SM = fwd_rows, tile, per_sm
        K._block = lambda n: (block, warps)
        return {"fwd_rows": fwd_rows, "bwd_tile": tile, "per_sm": per_sm, "warps": warps}

    for fwd_rows, warps in itertools.product((1, 2, 4), (2, 4, 8)):  # the forward alone
        row = setting(fwd_rows, DEFAULT[1], DEFAULT[2], warps)
        row["fwd_us"] = replay_us(fwd)
        rows.append(row)
        print(json.dumps(row), flush=True)
    for tile, per_sm, warps in itertools.chain(  # forward + backward, the default first
            [DEFAULT[1:]], itertools.product((1, 2, 4), (2, 4, 8, 16), (2, 4, 8))):
        row = setting(DEFAULT[0], tile, per_sm, warps)
        row["fwd_bwd_us"] = replay_us(lambda: fwd_bwd(1))
        row["fwd_bwd_fanout2_us"] = replay_us(lambda: fwd_bwd(2))
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(out, "w") as f:
        json.dump({"default": DEFAULT, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
