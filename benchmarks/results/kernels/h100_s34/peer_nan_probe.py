"""Which feature of the mamba3_scan check case gives mamba_ssm's op (the donor row) NaN: the
check case (B 2, L 300, 2 q/k groups of 2 heads, d_state 64, 16 rotated pairs, documents) and
variants that change one thing each. Prints, per variant, whether the peer's y is finite and
its relative error against the float64 reference; bf16 inputs, as `kernels check` runs.

    PYTHONPATH=src python benchmarks/results/kernels/h100_s34/peer_nan_probe.py
"""

import torch

from megacpp.kernels.ops.mamba3_scan.reference import mamba3_scan_chunked
from megacpp.kernels.peers import mamba3_siso_combined
from megacpp.kernels.registry import _mamba3_inputs

BASE = {"batch": 2, "seq": 300, "groups": 2, "heads": 4, "d_state": 64, "headdim": 64,
        "angles": 16, "chunk": 64, "resets": 1}
VARIANTS = {"check case": {}, "no documents": {"resets": 0}, "L 320": {"seq": 320},
            "L 320, no documents": {"seq": 320, "resets": 0}, "1 q/k group": {"groups": 1},
            "32 rotated pairs": {"angles": 32}, "batch 1": {"batch": 1},
            "batch 1, L 320": {"batch": 1, "seq": 320}}

for name, change in VARIANTS.items():
    case = {**BASE, **change}
    inp = _mamba3_inputs(case, torch.bfloat16, "cuda", torch.Generator("cuda").manual_seed(0))
    inp = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in inp.items()}
    inp["output_final_state"] = False
    try:
        y = mamba3_siso_combined(**inp)
    except Exception as exc:  # noqa: BLE001 -- reported per variant
        print(f"{name:24s} raised {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
        continue
    ref, _ = mamba3_scan_chunked(**{k: v.double() if isinstance(v, torch.Tensor)
                                    and v.is_floating_point() else v for k, v in inp.items()})
    bad = (~torch.isfinite(y)).sum().item()
    err = ((y.double() - ref).norm() / ref.norm()).item() if not bad else float("nan")
    rows = (~torch.isfinite(y)).any(-1).any(-1)  # [B, L] rows with a non-finite value
    where = rows.nonzero()[:4].tolist() if bad else []
    print(f"{name:24s} non-finite {bad:7d}  rel. err {err:.3e}  first bad (b, t): {where}",
          flush=True)
