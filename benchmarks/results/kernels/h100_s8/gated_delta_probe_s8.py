"""Session-8 dev probe: the gated delta rule's product precision and intermediate storage.
For each variant (bf16 products on/off x bf16 storage of u, v_new, T, dL/dv_new on/off):
fwd+bwd ms (do_bench median) and CUDA us per kernel at the catalog's cases, and the relative
errors against the float64 reference (tests' compare) on smaller shapes, next to fla's.
Variants name the BF16_PRODUCTS / BF16_STORAGE sets; "old" imports the session-start kernels
(git show 74eb331:src/megacpp/kernels/ops/gated_delta/triton.py > .device-carry/s8/gd_old.py).
    PYTHONPATH=$PWD/src:$PWD:/tmp/site python3 gated_delta_probe_s8.py CASES|- VARIANTS"""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import torch
from triton.testing import do_bench
import megacpp.kernels.ops.gated_delta.triton as gd
sys.path.insert(0, "benchmarks")
import gated_delta_tune as tune
from tests.kernels.test_gated_delta_triton import make_inputs, compare
from megacpp.kernels.peers import fla_chunk_gated_delta_rule

ALL = ("fwd_intra", "fwd_state", "fwd_out", "bwd_dv_local", "bwd_state", "bwd_val", "bwd_key",
       "bwd_fin")
CHEAP = ("bwd_dv_local", "bwd_fin", "bwd_val", "fwd_state")
VARIANTS = {"old": None, "tf32": ((), ()), "cheap": (CHEAP, ("dvn",)),
            "cheap_store": (CHEAP, ("dvn", "u", "v_new")), "all": (ALL, ("dvn", "u", "v_new"))}
sys.path.insert(0, ".device-carry/s8")
import gd_old  # the gated delta kernels at the session's start commit
NEW_FN = gd.gated_delta_rule_triton


def set_variant(name):
    if VARIANTS[name] is None:
        gd.gated_delta_rule_triton = gd_old.gated_delta_rule_triton
        return
    gd.gated_delta_rule_triton = NEW_FN
    prods, stores = VARIANTS[name]
    gd.BF16_PRODUCTS, gd.BF16_STORAGE = frozenset(prods), frozenset(stores)


out = {"device": torch.cuda.get_device_name(), "commit": os.environ.get("MEGACPP_SOURCE_COMMIT")}
cases = sys.argv[1].split(",") if len(sys.argv) > 1 and sys.argv[1] != "-" else []
variants = sys.argv[2].split(",") if len(sys.argv) > 2 else list(VARIANTS)
for case in cases:
    inputs = tune._inputs(case)
    do = torch.randn_like(inputs["v"])
    res = {}
    for v in variants:
        set_variant(v)
        tune._fwd_bwd(inputs, do)
        ms = do_bench(lambda: tune._fwd_bwd(inputs, do), warmup=50, rep=300, return_mode="median")
        bd = tune._breakdown(lambda: tune._fwd_bwd(inputs, do))
        res[v] = {"ms": ms, "us": {k: round(x, 1) for k, x in bd.items()}}
        if v == "tf32":
            res[v]["resources"] = tune._resources(inputs, do)
            print(json.dumps(res[v]["resources"]), flush=True)
        print(case, v, f"{ms:.3f} ms", json.dumps(res[v]["us"])[:400], flush=True)
    if os.environ.get("FLA", "1") == "1":
        run = tune._fla_fn(inputs, do)
        run()
        res["fla"] = {"ms": do_bench(run, warmup=50, rep=300, return_mode="median")}
        print(case, "fla", f"{res['fla']['ms']:.3f} ms", flush=True)
    out[case] = res
ERR = {"k128_doc": (2, 1024, 4, 128, 128, 300, False), "k64_doc": (2, 1024, 4, 64, 128, 300, False)}
errs = {}
for name, (B, L, H, K, V, doc, st) in ERR.items():
    inp = make_inputs(B, L, H, K, V, device="cuda", seed=11, doc_len=doc, with_state=st)
    for v in variants:
        set_variant(v)
        errs[f"{name}/{v}"] = compare(lambda **kw: gd.gated_delta_rule_triton(**kw), inp, torch.bfloat16, 1.0)
        print(name, v, {k: f"{x:.2e}" for k, x in errs[f"{name}/{v}"].items()}, flush=True)
    try:
        errs[f"{name}/fla"] = compare(fla_chunk_gated_delta_rule, inp, torch.bfloat16, 1.0)
    except Exception as exc:  # noqa: BLE001
        errs[f"{name}/fla"] = repr(exc)[:200]
    e = errs[f"{name}/fla"]
    print(name, "fla", e if isinstance(e, str) else {k: f"{x:.2e}" for k, x in e.items()}, flush=True)
out["errors"] = errs
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "gd_probe.json"), "w"), indent=1)
