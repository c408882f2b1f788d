"""Which change breaks dq/dk/dg at the catalog's check case (K 32, V 64, bf16) on the GPU?
    python k32.py VARIANT   (base | key_bv32 | val_bv32 | no_dqk | no_dkpart | fin_bks32 | all32)"""
import os, sys
sys.path.insert(0, os.getcwd())
import torch
import megacpp.kernels.ops.gated_delta.triton as gd
from megacpp.kernels.check import check_backend
from megacpp.kernels.registry import default_catalog
v = sys.argv[1]
if v in ("key_bv32", "all32"):
    gd.CONFIG["bwd_key"] = {**gd.CONFIG["bwd_key"], "BV": 32}
if v in ("val_bv32", "all32"):
    gd.CONFIG["bwd_val"] = {**gd.CONFIG["bwd_val"], "BV": 32}
if v == "no_dqk":
    gd.BF16_STORAGE = gd.BF16_STORAGE - {"dqk"}
if v == "no_dkpart":
    gd.BF16_STORAGE = gd.BF16_STORAGE - {"dk_part"}
if v == "no_T":
    gd.BF16_STORAGE = gd.BF16_STORAGE - {"T"}
if v == "key_stages1":
    gd.CONFIG["bwd_key"] = {**gd.CONFIG["bwd_key"], "num_stages": 1}
if v == "k128_bks32_bv64":  # the same tiles at K = 128 (bypassing the launcher's clamp)
    gd.CONFIG["bwd_key"] = {**gd.CONFIG["bwd_key"], "BKS": 32, "BV": 64}
    original = gd._Launcher.__call__

    def unclamped(self, kernel, name, per_chunk, *args, **const):
        if name == "bwd_key":
            import builtins
            real = builtins.min
            builtins.min = lambda a, b: a if (a, b) == (64, 32) else real(a, b)
            try:
                return original(self, kernel, name, per_chunk, *args, **const)
            finally:
                builtins.min = real
        return original(self, kernel, name, per_chunk, *args, **const)
    gd._Launcher.__call__ = unclamped
cat = default_catalog()
if v == "k128_bks32_bv64":
    from tests.kernels.test_gated_delta_triton import make_inputs, compare
    inp = make_inputs(2, 512, 2, 128, 128, device="cuda", seed=1, doc_len=100)
    print(v, compare(lambda **kw: gd.gated_delta_rule_triton(**kw), inp, torch.bfloat16, 1.0))
    sys.exit(0)
r = check_backend(cat.surface("gated_delta"), cat.backend("gated_delta", "triton_chunked"),
                  torch.device("cuda"), "bfloat16", 0)
print(f"{v:12}", r.passed, {k: f"{x:.1e}" for k, x in r.errors.items()}, flush=True)
