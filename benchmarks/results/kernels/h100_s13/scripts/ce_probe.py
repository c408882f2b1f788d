"""Session 13: the CE row kernel's launch settings and sweep-1 form, then the fused linear CE
fwd+bwd with the best ones against torch plain (same process, alternating rounds).
    OUT=... python ce_probe.py"""
import json, os, statistics, sys, time
import torch
from megacpp.kernels import timing
from megacpp.kernels.ops.linear_ce import triton as lce
from megacpp.kernels.ops.linear_ce.reference import linear_cross_entropy_torch
from megacpp.kernels.registry import default_catalog

OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda")
res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
SMS = torch.cuda.get_device_properties(dev).multi_processor_count
V, C = 65536, 1024
g = torch.Generator(device=dev).manual_seed(0)
src = (torch.randn(C, V, device=dev, generator=g) * 3).bfloat16()
labels = torch.randint(0, V, (C,), device=dev, generator=g)
labels[::13] = -100
inv_n = torch.tensor([1.0 / int((labels != -100).sum())], device=dev)
loss = torch.empty(C, device=dev)

# truth
logp = torch.log_softmax(src.float(), -1)
safe = labels.clamp(min=0)
kept = labels != -100
want_loss = torch.where(kept, -logp.gather(1, safe[:, None])[:, 0], 0.0)
want_grad = (logp.exp() - torch.nn.functional.one_hot(safe, V)) * inv_n
want_grad[~kept] = 0
del logp

def launch(work, block, warps, pps, lanes):
    lce._ce_rows[(min(C, pps * SMS),)](work, labels, loss, inv_n, C, work.stride(0), -100,
                                      n_cols=V, BLOCK=block, WRITE_GRAD=True, LANES=lanes,
                                      num_warps=warps)

def check(block, warps, pps, lanes):
    work = src.clone()
    launch(work, block, warps, pps, lanes)
    el = float((loss - want_loss).abs().max())
    eg = float((work.float() - want_grad).norm() / want_grad.norm())
    return el, eg

def time_kernel(block, warps, pps, lanes, n=30):
    work = src.clone()
    for _ in range(3):
        launch(work, block, warps, pps, lanes)
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        work.copy_(src)  # fresh logits each time (the kernel writes in place)
        b, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        b.record(); launch(work, block, warps, pps, lanes); e.record()
        torch.cuda.synchronize()
        ts.append(b.elapsed_time(e))
    return statistics.median(ts) * 1e3  # us

sweep = {}
t0 = time.time()
for lanes in (False, True):
    for block in (2048, 4096, 8192, 16384):
        for warps in (4, 8, 16, 32):
            if block // (32 * warps) > 32 or block < 32 * warps:
                continue
            for pps in (1, 2, 4, 8):
                if warps * pps > 64:
                    continue
                key = f"lanes{int(lanes)}_B{block}_w{warps}_p{pps}"
                try:
                    us = time_kernel(block, warps, pps, lanes)
                except Exception as exc:  # noqa: BLE001
                    sweep[key] = repr(exc)[:120]; print(key, sweep[key], flush=True); continue
                sweep[key] = us
                print(f"{key:28s} {us:8.1f} us  {2 * C * V * 2 / us / 1e3:7.0f} GB/s (1 read + 1 write)", flush=True)
print(f"sweep took {time.time() - t0:.0f}s", flush=True)
res["sweep_us"] = sweep
ranked = sorted((v, k) for k, v in sweep.items() if isinstance(v, float))
res["ranked"] = ranked[:10]
default_key = "lanes0_B4096_w16_p2"
print("default", default_key, sweep.get(default_key), "best", ranked[:5], flush=True)

def parse(k):
    l, b, w, p = k.split("_")
    return int(b[1:]), int(w[1:]), int(p[1:]), l == "lanes1"

checks = {}
for _, k in ranked[:5] + [(0, default_key)]:
    checks[k] = check(*parse(k))
    print("check", k, checks[k], flush=True)
res["checks"] = checks

# full op, per call and replay, alternating rounds: default, best 2, torch plain
surface = default_catalog().surface("linear_cross_entropy")
inputs = surface.make_inputs(surface.cases["bench"], torch.bfloat16, dev,
                             torch.Generator(device=dev).manual_seed(0))
base = dict(lce.CE_CONFIG)
configs = {"default": base}
for _, k in ranked[:2]:
    b, w, p, l = parse(k)
    configs[k] = {"BLOCK": b, "num_warps": w, "programs_per_sm": p, "lanes": l}
full = {name: {"call": [], "replay": []} for name in list(configs) + ["torch_plain"]}
for rnd in range(3):
    for name in full:
        if name == "torch_plain":
            fn = linear_cross_entropy_torch
        else:
            lce.CE_CONFIG.update(configs[name]); fn = lce.linear_cross_entropy_triton
        t = timing.time_fwd_bwd(fn, inputs, surface.grad_args, dev, repeats=10)
        r = timing.time_fwd_bwd_graphed(fn, inputs, surface.grad_args, dev, repeats=10)
        full[name]["call"].append(t.median_ms); full[name]["replay"].append(r.median_ms)
        full[name]["peak_gib"] = t.peak_extra_bytes / 2**30
        print(f"round {rnd} {name:26s} call {t.median_ms:7.3f} ms replay {r.median_ms:7.3f} ms "
              f"peak {t.peak_extra_bytes / 2**30:.4f} GiB", flush=True)
        lce.CE_CONFIG.update(base)
for name, d in full.items():
    d["call_median"] = statistics.median(d["call"]); d["replay_median"] = statistics.median(d["replay"])
    print(f"{name:26s} call {d['call_median']:.3f} replay {d['replay_median']:.3f}", flush=True)
res["full"] = full

# where the op's time goes with the best config
from torch.profiler import ProfilerActivity, profile
lce.CE_CONFIG.update(configs[ranked[0][1]])
cot = timing._cotangents(lce.linear_cross_entropy_triton, inputs)
step = lambda: timing._fwd_bwd(lce.linear_cross_entropy_triton, inputs, surface.grad_args, cot)
step(); torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
tab = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60)
print(tab, flush=True)
open(f"{OUT}/ce_profile_best.txt", "w").write(tab)
json.dump(res, open(f"{OUT}/ce_probe.json", "w"), indent=1)
