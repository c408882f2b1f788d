"""Session-9 dev probe: gated delta kernel variants (module snapshots in .device-carry/s9:
gd_head = 936e8bd's kernels; gd_a = bf16 T / d_qk storage, transposed k/q/w loads in the state
passes, decay scales after products, bwd_key epilogue reordered; gd_b = a + bwd_fin's
transpose in registers; gd_c = b + bwd_val's u part as ((T^T du)(beta v)^T) T^T; gd_d = c +
T by block doubling), fwd+bwd ms (do_bench median), CUDA us per kernel, registers/spills,
and errors against the float64 reference.
    python .device-carry/s9/gd_probe9.py CASES VARIANTS   (VARIANT: module[+dk_part][+key8])"""
import importlib, json, os, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, ".device-carry/s9"); sys.path.insert(0, "benchmarks")
import torch
from triton.testing import do_bench
import gated_delta_tune as tune
from tests.kernels.test_gated_delta_triton import make_inputs, compare
from megacpp.kernels.peers import fla_chunk_gated_delta_rule

T0 = time.time()
OUT = os.path.join(os.environ.get("OUT", "/tmp"), "gd_probe9.json")
res = {"device": torch.cuda.get_device_name(), "commit": os.environ.get("MEGACPP_SOURCE_COMMIT")}


def variant(spec):
    """(module, wrap): wrap(f) runs f with the spec's options set on the module, then restores
    them (an option must hold over the backward too, so it wraps whole fwd+bwd calls)."""
    name, *opts = spec.split("+")
    mod = importlib.import_module(name)

    def wrap(f):
        saved = (mod.BF16_STORAGE, dict(mod.CONFIG["bwd_key"]))
        if "dk_part" in opts:
            mod.BF16_STORAGE = frozenset(mod.BF16_STORAGE | {"dk_part"})
        if "key8" in opts:
            mod.CONFIG["bwd_key"] = {**mod.CONFIG["bwd_key"], "num_warps": 8}
        try:
            return f()
        finally:
            mod.BF16_STORAGE, mod.CONFIG["bwd_key"] = saved[0], saved[1]
    return mod, wrap


def fwd_bwd(fn, inputs, do):
    args = {n: t.detach().requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point()
            else t for n, t in inputs.items()}
    o, _ = fn(**args)
    return torch.autograd.grad(o, [args[n] for n in ("q", "k", "v", "g", "beta")], do)


def resources(mod, fn):
    seen, original = {}, mod._Launcher.__call__

    def spy(self, kernel, name, per_chunk, *args, **const):
        c = original(self, kernel, name, per_chunk, *args, **const)
        seen[name] = (c.n_regs, c.n_spills)
        return c
    mod._Launcher.__call__ = spy
    try:
        fn()
    finally:
        mod._Launcher.__call__ = original
    return seen


cases = [c for c in sys.argv[1].split(",") if c and c != "-"]
specs = sys.argv[2].split(",")
for case in cases:
    inputs = tune._inputs(case)
    do = torch.randn_like(inputs["v"])
    r = res.setdefault(case, {})
    for spec in specs + ([] if os.environ.get("NOFLA") else ["fla"]):
        if spec == "fla":
            fn, wrap = fla_chunk_gated_delta_rule, lambda f: f()
        else:
            mod, wrap = variant(spec)
            fn = mod.gated_delta_rule_triton
        run = lambda: wrap(lambda: fwd_bwd(fn, inputs, do))  # noqa: E731
        run()
        ms = do_bench(run, warmup=25, rep=200, return_mode="median")
        bd = tune._breakdown(run)
        r[spec] = {"ms": ms, "us": {k: round(x, 1) for k, x in bd.items()}}
        if spec != "fla":
            r[spec]["regs"] = resources(sys.modules[spec.split("+")[0]], run)
        print(f"{time.time() - T0:5.0f}s", case, spec, f"{ms:.3f} ms", json.dumps(r[spec]["us"])[:420],
              r[spec].get("regs", ""), flush=True)
        json.dump(res, open(OUT, "w"), indent=1)
ERR = {"k128_doc": (2, 1024, 4, 128, 128, 300), "k64_doc": (2, 1024, 4, 64, 128, 300)}
if os.environ.get("ERR", "1") == "1":
    errs = res.setdefault("errors", {})
    for name, (B, L, H, K, V, doc) in ERR.items():
        inp = make_inputs(B, L, H, K, V, device="cuda", seed=11, doc_len=doc)
        for spec in specs + (["fla"] if K == 128 else []):
            if spec == "fla":
                fn, wrap = fla_chunk_gated_delta_rule, lambda f: f()
            else:
                mod, wrap = variant(spec)
                fn = mod.gated_delta_rule_triton
            try:
                e = wrap(lambda: compare(lambda **kw: fn(**kw), inp, torch.bfloat16, 1.0))
                errs[f"{name}/{spec}"] = e
                print(f"{time.time() - T0:5.0f}s", name, spec, f"max {max(e.values()):.2e}",
                      {k: f"{x:.1e}" for k, x in e.items()}, flush=True)
            except Exception as exc:  # noqa: BLE001
                errs[f"{name}/{spec}"] = repr(exc)[:300]
                print(name, spec, repr(exc)[:300], flush=True)
            json.dump(res, open(OUT, "w"), indent=1)
