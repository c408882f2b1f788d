"""Two fwd+bwd of the gated delta rule on the same inputs must agree bit for bit."""
import torch

from megacpp.kernels.ops.gated_delta.triton import gated_delta_rule_triton
from megacpp.kernels.registry import default_catalog

surface = default_catalog().surface("gated_delta")
for case in ("nam56r_4k", "h16_d128_4k"):
    gen = torch.Generator("cuda").manual_seed(0)
    inp = surface.make_inputs(surface.cases[case], torch.bfloat16, torch.device("cuda"), gen)
    do = torch.randn(inp["v"].shape, device="cuda", dtype=torch.bfloat16)
    outs = []
    for _ in range(2):
        args = {n: t.detach().requires_grad_() if isinstance(t, torch.Tensor) and
                t.is_floating_point() else t for n, t in inp.items()}
        o, _ = gated_delta_rule_triton(**args)
        outs.append((o, *torch.autograd.grad(o, [args[n] for n in ("q", "k", "v", "g", "beta")],
                                              do)))
    same = all(torch.equal(a, b) for a, b in zip(*outs))
    print(case, "two runs bit-identical:", same)
