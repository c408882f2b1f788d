"""The state passes' hand prefetch under ncu: _fwd_state as now (loads in their own chunk) and
_bwd_state with and without its prefetch, fwd+bwd at nam56r 4k and H16 (one call per variant
and shape inside a cudaProfilerStart/Stop range). Variants are text edits loaded from /tmp."""
import importlib.util

import torch

from megacpp.kernels.registry import default_catalog

SRC = open("src/megacpp/kernels/ops/gated_delta/triton.py").read()
BASE = SRC[SRC.index("    # the loads that feed no product (do, dL/dv_new's local part"):
           SRC.index("        dhs_ptrs, _ = _state_tile(DHS,")]
DIRECT = '''    for i in range(_loop_count(N, N_CONST)):
        n = N - 1 - i
        do, decay_in, gamma = _state_loads(DO, DIN, GAM, b, bh, n, v0, L, N, H, DV, BV, BT)
        dv_new, decay_out, _g = _state_loads(DVN, DOUT, GAM, b, bh, n, v0, L, N, H, DV, BV, BT)
'''
VARIANTS = {"bwd_prefetch": SRC, "bwd_direct": SRC.replace(BASE, DIRECT)}


def load(name, src):
    path = f"/tmp/gdb_{name}.py"
    open(path, "w").write(src)
    spec = importlib.util.spec_from_file_location(f"gdb_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fwd_bwd(mod, inputs, do):
    args = {n: t.detach().requires_grad_() if isinstance(t, torch.Tensor) and
            t.is_floating_point() else t for n, t in inputs.items()}
    o, _ = mod.gated_delta_rule_triton(**args)
    return o, torch.autograd.grad(o, [args[n] for n in ("q", "k", "v", "g", "beta")], do)


surface = default_catalog().surface("gated_delta")
mods = {name: load(name, src) for name, src in VARIANTS.items()}
cases = {}
for case in ("nam56r_4k", "h16_d128_4k"):
    gen = torch.Generator("cuda").manual_seed(0)
    inp = surface.make_inputs(surface.cases[case], torch.bfloat16, torch.device("cuda"), gen)
    do = torch.randn(inp["v"].shape, device="cuda", dtype=torch.bfloat16)
    cases[case] = (inp, do)
    ref = None
    for name, mod in mods.items():
        _o, grads = fwd_bwd(mod, inp, do)
        ref = grads if ref is None else ref
        print(case, name, "max |grad - first| =",
              max(float((a.float() - b.float()).abs().max()) for a, b in zip(grads, ref)))
torch.cuda.synchronize()
torch.cuda.profiler.start()
for case, (inp, do) in cases.items():
    for name, mod in mods.items():
        fwd_bwd(mod, inp, do)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
