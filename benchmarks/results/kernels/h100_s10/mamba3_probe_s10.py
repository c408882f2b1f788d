"""Dev sweep of the Mamba-3 scan kernels on one GPU (session 10): smoke + fwd+bwd timings of
TUNING variants of the kernels, the previous kernels ('old': a copy of 8a7fde0's
ops/mamba3_scan/triton.py saved as mamba3_old.py next to this file, in the same process) and
the peer (LONG="a;b": variants also timed at 8192).
    PYTHONPATH=$PWD/src:/tmp/site python3 mamba3_probe_s10.py VARIANTS..."""
import copy
import json
import os
import sys
import time

import torch

T_START = time.time()
BUDGET = float(os.environ.get("PROBE_BUDGET", "150"))
OUT = os.environ.get("OUT", "/tmp")
sys.path.insert(0, "tests/kernels")
import test_mamba3_triton as tm  # noqa: E402

from megacpp.kernels.ops.mamba3_scan import triton as mt  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mamba3_old  # noqa: E402
from megacpp.kernels.registry import _mamba3_inputs  # noqa: E402
from megacpp.kernels.timing import cuda_times_ms, time_fwd_bwd  # noqa: E402

GRADS = ("q", "k", "v", "adt", "dt", "trap", "q_bias", "k_bias", "angles", "D", "z")
LOG = open(f"{OUT}/probe.log", "a")
RESULTS = []
BASE = copy.deepcopy(mt.TUNING)


def say(*a):
    print(*a, flush=True)
    print(*a, file=LOG, flush=True)


def case(seq):
    c = {"batch": 8, "seq": seq, "groups": 1, "heads": 32, "d_state": 128, "headdim": 64,
         "angles": 32, "chunk": 64}
    c.update(json.loads(os.environ.get("M3_CASE", "{}")))
    return c


def variant(name):
    """name: 'base' or comma-separated settings of TUNING, e.g.
    dqk_pairs=16,launch.bwd_dqk.num_warps=4"""
    t = copy.deepcopy(BASE)
    if name != "base":
        for item in name.split(","):
            key, value = item.split("=")
            *path, last = key.split(".")
            d = t
            for part in path:
                d = d[part]
            d[last] = int(value) if value.lstrip("-").isdigit() else value == "True"
    mt.TUNING.clear()
    mt.TUNING.update(t)


def smoke(fn):
    inputs, reset = tm.make_inputs(1, 300, 1, 4, 128, 64, 32, torch.bfloat16, "cuda", 7)
    try:
        err = tm.compare(fn, inputs, reset, 64, 1e-2)
        return max(err.values())
    except AssertionError as e:
        say("SMOKE FAIL", str(e)[:600])
        return float("nan")


def kernel_resources(mod):
    out = {}
    for name in dir(mod):
        fn = getattr(mod, name)
        if not hasattr(fn, "device_caches") or not name.startswith("_"):
            continue
        try:
            for cache in fn.device_caches.values():
                for ck in cache[0].values():
                    key = f"{name}/w{ck.metadata.num_warps}"
                    out[key] = (ck.n_regs, ck.n_spills, ck.metadata.shared)
        except Exception as e:  # noqa: BLE001
            out[name] = repr(e)[:100]
    return out


def profile(fn, inputs):
    from torch.profiler import ProfilerActivity, profile as prof
    outs = fn(**inputs)
    y = outs[0] if isinstance(outs, tuple) else outs
    cot = torch.randn_like(y)
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(3):
            o = fn(**inputs)
            yy = o[0] if isinstance(o, tuple) else o
            torch.autograd.grad(yy, [inputs[n] for n in GRADS], cot)
        torch.cuda.synchronize()
    tot = {}
    for e in p.events():
        if e.device_type.name == "CUDA":
            tot[e.name[:40]] = tot.get(e.name[:40], 0) + e.device_time_total / 3
    return {k: round(v) for k, v in sorted(tot.items(), key=lambda kv: -kv[1])[:16]}


def time_variant(fn, seq, label, prof_it=False):
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = _mamba3_inputs(case(seq), torch.bfloat16, "cuda", gen)
    t = time_fwd_bwd(fn, inputs, GRADS, torch.device("cuda"), warmup=2, repeats=7)
    fw = sorted(cuda_times_ms(lambda: fn(**inputs), warmup=1, iters=5))[2]
    row = {"variant": label, "seq": seq, "fwd_bwd_ms": round(t.median_ms, 3),
           "fwd_ms": round(fw, 3), "peak_gib": round((t.peak_extra_bytes or 0) / 2**30, 2)}
    if prof_it:
        row["profile_us"] = profile(fn, inputs)
    say(json.dumps(row))
    RESULTS.append(row)
    inputs = None
    torch.cuda.empty_cache()


def main(names):
    say(f"# {torch.cuda.get_device_name()} torch {torch.__version__} "
        f"{time.strftime('%Y-%m-%d %H:%M')}")
    long = os.environ.get("LONG", "").split(";")
    for name in names:
        if time.time() - T_START > BUDGET:
            say("budget reached before", name)
            break
        if name == "peer":
            from megacpp.kernels.peers import mamba3_siso_combined
            for seq in (4096,):
                time_variant(mamba3_siso_combined, seq, "peer_mamba_ssm")
            continue
        if name == "old":
            fn, mod = mamba3_old.mamba3_scan_triton, mamba3_old
        else:
            variant(name)
            fn, mod = mt.mamba3_scan_triton, mt
        t0 = time.time()
        err = smoke(fn)
        say(f"{name}: smoke max rel err {err:.2e} ({time.time() - t0:.0f}s incl. compile)")
        if err == err:
            time_variant(fn, 4096, name, prof_it=bool(os.environ.get("PROFILE_ALL")) or name == names[0])
            if name in long:
                time_variant(fn, 8192, name)
        say(name, json.dumps(kernel_resources(mod)))
    json.dump(RESULTS, open(f"{OUT}/probe_{int(T_START)}.json", "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
