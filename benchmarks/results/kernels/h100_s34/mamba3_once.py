"""One fwd+bwd of our Mamba-3 scan (or, with ``peer``, mamba_ssm's through the catalog's adapter)
at the bench's shape (B 8, L 4096, 32 heads of d_state 128, bf16; registry._mamba3_inputs), for
Nsight Compute (``--profile-from-start off``: the second fwd+bwd is profiled).

    PYTHONPATH=src python benchmarks/results/kernels/h100_s34/mamba3_once.py [peer]
"""

import sys

import torch

from megacpp.kernels.ops.mamba3_scan import triton as M
from megacpp.kernels.registry import _mamba3_inputs

CASE = {"batch": 8, "seq": 4096, "groups": 1, "heads": 32, "d_state": 128, "headdim": 64,
        "angles": 32, "chunk": 64, "final_state": 0}
GRADS = ("q", "k", "v", "adt", "dt", "trap", "q_bias", "k_bias", "angles", "D", "z")

dev = torch.device("cuda")
inp = _mamba3_inputs(CASE, torch.bfloat16, dev, torch.Generator(device=dev).manual_seed(0))
if sys.argv[1:] == ["peer"]:
    from megacpp.kernels.peers import mamba3_siso_combined as scan
else:
    def scan(**kw):
        return M.mamba3_scan_triton(**kw)[0]


def fwd_bwd() -> None:
    y = scan(**inp)
    torch.autograd.grad(y, [inp[n] for n in GRADS], torch.randn_like(y))


fwd_bwd()  # compiles (and autotunes the peer's kernels) outside the profiled range
torch.cuda.synchronize()
torch.cuda.profiler.start()  # ncu --profile-from-start off: the second fwd+bwd only
fwd_bwd()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
