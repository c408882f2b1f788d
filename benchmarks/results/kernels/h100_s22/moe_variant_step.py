"""The training step (benchmarks/train_step.py, same arguments after the first) with the MoE's
expert-sorted operands read through the plan by only some of their consumers (session 22):

    all       the tree: gate|up and d hidden (grouped_mm_triton) and both wgrads
    mm        the two GEMMs; the wgrads get the permute materialized (dout's scattered once,
              after d hidden has read it through the plan; x's scattered in the backward)
    mm_dwout  the two GEMMs and dw_out (dout); dw_in gets x's permute materialized

    PYTHONPATH=$PWD/src python benchmarks/results/kernels/h100_s22/moe_variant_step.py VARIANT \
        --preset nam56r-350m ... --out OUT.json
"""

import runpy
import sys
from pathlib import Path

from megacpp.kernels.ops.moe import grouped

VARIANT = sys.argv.pop(1)
assert VARIANT in ("all", "mm", "mm_dwout"), VARIANT
_ops = grouped._ops


def _patched(device):
    ops = _ops(device)
    wgrad = ops.wgrad

    def materialized_wgrad(a, b, offs, out_dtype, transpose_out=False):
        keep = VARIANT == "mm_dwout" and transpose_out  # dw_out reads dout through the plan
        if isinstance(b, grouped.Permuted) and not keep:
            b = b.rows()
        return wgrad(a, b, offs, out_dtype, transpose_out)

    return ops._replace(wgrad=materialized_wgrad) if VARIANT != "all" else ops


grouped._ops = _patched
sys.argv[0] = str(Path(__file__).resolve().parents[3] / "train_step.py")
runpy.run_path(sys.argv[0], run_name="__main__")
