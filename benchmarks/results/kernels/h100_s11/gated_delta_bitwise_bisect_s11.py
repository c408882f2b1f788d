"""Which output of the gated delta rule differs between repeated fwd+bwd at H16, and under
which launch settings (CONFIG edits, one at a time): 4 runs each on the same inputs."""
import copy
import sys

import torch

from megacpp.kernels.ops.gated_delta import triton as gd
from megacpp.kernels.registry import default_catalog

NAMES = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta")
BASE = copy.deepcopy(gd.CONFIG)
surface = default_catalog().surface("gated_delta")
case = sys.argv[1] if len(sys.argv) > 1 else "h16_d128_4k"
gen = torch.Generator("cuda").manual_seed(0)
inp = surface.make_inputs(surface.cases[case], torch.bfloat16, torch.device("cuda"), gen)
do = torch.randn(inp["v"].shape, device="cuda", dtype=torch.bfloat16)


def once():
    args = {n: t.detach().requires_grad_() if isinstance(t, torch.Tensor) and
            t.is_floating_point() else t for n, t in inp.items()}
    o, ht = gd.gated_delta_rule_triton(**args)
    grads = torch.autograd.grad(o, [args[n] for n in ("q", "k", "v", "g", "beta")], do)
    return (o, ht, *grads)


VARIANTS = {
    "base": {},
    "bwd_state s2": {"bwd_state": {"num_stages": 2}},
    "bwd_state direct": {"bwd_state": {"prefetch": 0}},
    "fwd_state s3": {"fwd_state": {"num_stages": 3}},
    "fwd_out s1": {"fwd_out": {"num_stages": 1}},
    "bwd_val s1": {"bwd_val": {"num_stages": 1}},
    "bwd_key s1": {"bwd_key": {"num_stages": 1}},
    "bwd_dv_local s1": {"bwd_dv_local": {"num_stages": 1}},
    "fwd_intra s2": {"fwd_intra": {"num_stages": 2}},
}
for label, edit in VARIANTS.items():
    gd.CONFIG.clear()
    gd.CONFIG.update(copy.deepcopy(BASE))
    for k, v in edit.items():
        gd.CONFIG[k].update(v)
    try:
        runs = [once() for _ in range(4)]
    except Exception as exc:  # noqa: BLE001
        print(label, "failed:", repr(exc)[:200], flush=True)
        continue
    diffs = {}
    for i, name in enumerate(NAMES):
        if runs[0][i] is None:
            continue
        d = max(float((r[i].float() - runs[0][i].float()).abs().max()) for r in runs[1:])
        if d:
            diffs[name] = f"{d:.3g}"
    print(case, label, "differs:", diffs or "none", flush=True)
