"""sum_rows probe (dev record, session 16): torch's ``partials.sum(0)`` against ops.sum_rows
(several tile shapes) at the partial shapes of the nam56r-350m step, each timed as a CUDA graph
of 50 back-to-back calls (per-call time = replay / 50).

    PYTHONPATH=$PWD/src:$PWD python benchmarks/results/kernels/h100_s16/sum_rows_probe.py OUT
"""

import json
import statistics
import sys

import torch

from megacpp.kernels.ops import sum_rows as S
from megacpp.kernels.timing import capture_graph, cuda_times_ms

SHAPES = ((1024, 768), (528, 64), (512, 64), (256, 1536))
TILES = ((32, 64, 4), (64, 64, 4), (32, 32, 4), (16, 128, 4), (64, 128, 8), (128, 32, 4))
CALLS = 50


def per_call_us(fn) -> float:
    graph, _ = capture_graph(lambda: [fn() for _ in range(CALLS)])
    return statistics.median(cuda_times_ms(graph.replay, warmup=3, iters=20)) * 1e3 / CALLS


def main(out: str) -> None:
    rows = []
    for shape in SHAPES:
        p = torch.randn(*shape, device="cuda")
        rows.append({"shape": shape, "fn": "torch.sum(0)", "us": per_call_us(lambda p=p: p.sum(0))})
        print(json.dumps(rows[-1]), flush=True)
        want = p.double().sum(0)
        for br, bc, warps in TILES:
            S.BLOCK_R, S.BLOCK_C, S.NUM_WARPS = br, bc, warps
            err = float((S.sum_rows(p).double() - want).norm() / want.norm())
            rows.append({"shape": shape, "fn": f"sum_rows {br}x{bc} w{warps}", "rel_err": err,
                         "us": per_call_us(lambda p=p: S.sum_rows(p))})
            print(json.dumps(rows[-1]), flush=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
