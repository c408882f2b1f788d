"""Session 32 sweep: the MoE plan with the permute in its second kernel (plan_permute_triton)
against the plan then the row scatter (plan_triton + scatter_rows_triton), GPU time only
(``triton.testing.do_bench``, median ms), at the bench's cases, for launch settings of the
permute: (PERMUTE_COLS, PERMUTE_TILE, PERMUTE_WARPS).

usage: python3 permute_sweep.py OUT_JSON

Ran at 8870f00 (7df7251 then chose its setting): ``plan_permute_triton`` and ``PLAN_PERMUTE`` were taken out after call 3
(704c7e5), so this script runs only on that tree.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

from megacpp.kernels.ops.moe import triton as mk
from megacpp.kernels.registry import default_catalog

SETTINGS = ((128, 16384, 8), (128, 8192, 8), (128, 8192, 4), (128, 4096, 4), (256, 16384, 8),
            (256, 8192, 4), (64, 4096, 4), (64, 2048, 4), (64, 8192, 8))


def main() -> None:
    out_path = Path(sys.argv[1])
    dev = torch.device("cuda")
    surface = default_catalog().surface("moe_experts")
    res = {}
    for case in ("e64_k8", "e16_k2"):
        gen = torch.Generator(device=dev).manual_seed(0)
        inp = surface.make_inputs(surface.cases[case], torch.bfloat16, dev, gen)
        x, idx, w, e = inp["x"], inp["expert_idx"], inp["weights"], inp["w_in"].shape[0]
        want = mk.scatter_rows_triton(x, mk.plan_triton(idx, w, e)[1])

        def separate():
            plan = mk.plan_triton(idx, w, e)
            return mk.scatter_rows_triton(x, plan[1])

        rows = {"plan_triton + scatter_rows_triton": do_bench(separate, return_mode="median"),
                "plan_triton alone": do_bench(lambda: mk.plan_triton(idx, w, e),
                                              return_mode="median")}
        for cols, tile, warps in SETTINGS:
            mk.PERMUTE_COLS, mk.PERMUTE_TILE, mk.PERMUTE_WARPS = cols, tile, warps
            _, xs = mk.plan_permute_triton(idx, w, e, x)
            assert torch.equal(xs, want), (case, cols, tile, warps)
            rows[f"fused cols {cols} tile {tile} warps {warps}"] = do_bench(
                lambda: mk.plan_permute_triton(idx, w, e, x), return_mode="median")
        res[case] = rows
        print(f"== {case} (ms, GPU median)")
        for name, ms in rows.items():
            print(f"  {name:44s} {ms * 1e3:8.1f} us", flush=True)
    out_path.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
