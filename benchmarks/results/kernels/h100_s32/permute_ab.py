"""Session 32 A/B in one process: the MoE bench rows' per-call and replayed fwd+bwd with the
forward's permute in the plan's kernel (``PLAN_PERMUTE`` on) and as the row scatter's own
launch (off), alternating, ROUNDS rounds, as ``benchmarks/kernels.py`` times them
(``time_fwd_bwd``, ``time_fwd_bwd_graphed``: medians of 10).

usage: python3 permute_ab.py OUT_JSON

Ran at 7df7251: ``plan_permute_triton`` and ``PLAN_PERMUTE`` were taken out after call 3
(704c7e5), so this script runs only on that tree.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

from megacpp.kernels.ops.moe import triton as mk
from megacpp.kernels.registry import default_catalog
from megacpp.kernels.timing import time_fwd_bwd, time_fwd_bwd_graphed

ROUNDS = 4


def main() -> None:
    dev = torch.device("cuda")
    cat = default_catalog()
    surface = cat.surface("moe_experts")
    fn = cat.backend("moe_experts", "grouped_mm").fn
    res = {}
    for case in ("e64_k8", "e16_k2"):
        gen = torch.Generator(device=dev).manual_seed(0)
        inp = surface.make_inputs(surface.cases[case], torch.bfloat16, dev, gen)
        runs = {True: {"call": [], "replay": []}, False: {"call": [], "replay": []}}
        for _ in range(ROUNDS):
            for on in (False, True):
                mk.PLAN_PERMUTE = on
                runs[on]["call"].append(time_fwd_bwd(fn, inp, surface.grad_args, dev).median_ms)
                runs[on]["replay"].append(
                    time_fwd_bwd_graphed(fn, inp, surface.grad_args, dev).median_ms)
        res[case] = {("on" if on else "off"): r for on, r in runs.items()}
        for on in (False, True):
            r = runs[on]
            print(f"{case} PLAN_PERMUTE {'on ' if on else 'off'}: per call "
                  f"{' '.join(f'{v:.3f}' for v in r['call'])} (median "
                  f"{statistics.median(r['call']):.3f}); replay "
                  f"{' '.join(f'{v:.3f}' for v in r['replay'])} (median "
                  f"{statistics.median(r['replay']):.3f}) ms", flush=True)
    Path(sys.argv[1]).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
