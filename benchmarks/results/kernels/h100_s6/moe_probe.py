"""MoE permute probe (dev only): the row gather vs the row scatter that build the expert-sorted
x (and dy) of the grouped path, at the moe_experts bench cases of the kernel registry.
    PYTHONPATH=$PWD/src:$PWD:/tmp/site python .device-carry/s6/moe_probe.py

(a) CUDA-event median (60 reps of 10 back-to-back calls, so a launch's host time hides under the
    previous kernel) of gather_rows_triton(x, token_of) vs scatter_rows_triton(x, inv) (the
    default launch shape and a few others), outputs checked equal;
(b) moe_experts_grouped forward+backward with grouped.PERMUTE = gather / scatter, interleaved
    A/B/A/B over 4 rounds, each round time_fwd_bwd's median of 20 reps;
(c) torch.profiler self CUDA time per kernel name for one forward+backward of each setting
    (forward_backward's loss adds a few small elementwise kernels to both).
One JSON line per result; all rows to $OUT/moe_probe.json ($OUT unset: /tmp)."""

import json
import os
import statistics
import sys
from pathlib import Path

import torch

from megacpp.kernels.check import forward_backward
from megacpp.kernels.ops.moe import grouped as G
from megacpp.kernels.registry import default_catalog
from megacpp.kernels.timing import cuda_times_ms, time_fwd_bwd

CASES = ("e64_k8", "e16_k2")
SCATTER_SHAPES = ((4, 4), (16, 4), (16, 8))  # (tokens, warps) besides the module default
CALLS_PER_EVENT = 10
OUT = Path(os.environ.get("OUT") or "/tmp")
rows: list[dict] = []


def say(row: dict) -> None:
    print(json.dumps(row), flush=True)
    rows.append(row)


def dump() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "moe_probe.json").write_text(json.dumps(rows, indent=1))


def median_ms(fn) -> float:
    """Median time of one call of ``fn``, from events around CALLS_PER_EVENT calls."""
    def calls() -> None:
        for _ in range(CALLS_PER_EVENT):
            fn()

    return statistics.median(cuda_times_ms(calls, warmup=2, iters=60)) / CALLS_PER_EVENT


def permute_kernels(case: str, inp: dict) -> None:
    """(a): the permute alone, gather vs scatter, on the plan the grouped path builds."""
    from megacpp.kernels.ops.moe import triton as K

    x, w_in = inp["x"].detach(), inp["w_in"]
    plan = G.dispatch_plan(inp["expert_idx"], w_in.shape[0], inp["weights"])
    n_rows, n_tokens = plan.token_of.numel(), x.shape[0]
    write_bytes = n_rows * x.shape[1] * x.element_size()
    ideal_bytes = write_bytes + n_tokens * x.shape[1] * x.element_size()  # each row read once
    want = K.gather_rows_triton(x, plan.token_of)

    def report(form: str, shape: str, fn) -> None:
        ms = median_ms(fn)
        say({"case": case, "step": "permute", "form": form, "shape": shape,
             "equal": torch.equal(fn(), want), "us": round(ms * 1e3, 1),
             "write_gbs": round(write_bytes / ms / 1e6),
             "ideal_gbs": round(ideal_bytes / ms / 1e6)})

    report("gather", f"r{K.GATHER_ROWS}_w{K.GATHER_WARPS}",
           lambda: K.gather_rows_triton(x, plan.token_of))
    default = (K.SCATTER_TOKENS, K.SCATTER_WARPS)
    try:
        for tokens, warps in (default, *SCATTER_SHAPES):
            K.SCATTER_TOKENS, K.SCATTER_WARPS = tokens, warps
            report("scatter", f"t{tokens}_w{warps}", lambda: K.scatter_rows_triton(x, plan.inv))
    finally:
        K.SCATTER_TOKENS, K.SCATTER_WARPS = default


def end_to_end(case: str, inp: dict, grad_args: tuple[str, ...]) -> None:
    """(b): the grouped path's forward+backward, gather and scatter interleaved."""
    device = inp["x"].device
    times: dict[str, list[float]] = {form: [] for form in G.PERMUTES}
    default = G.PERMUTE
    try:
        for rnd in range(4):
            for form in G.PERMUTES:
                G.PERMUTE = form
                t = time_fwd_bwd(G.moe_experts_grouped, inp, grad_args, device, repeats=20)
                times[form].append(t.median_ms)
                say({"case": case, "step": "fwd_bwd", "permute": form, "round": rnd,
                     "ms": round(t.median_ms, 4),
                     "peak_extra_gib": round((t.peak_extra_bytes or 0) / 2**30, 3)})
    finally:
        G.PERMUTE = default
    med = {form: round(statistics.median(ms), 4) for form, ms in times.items()}
    say({"case": case, "step": "fwd_bwd_summary", "median_of_rounds_ms": med,
         "spread_ms": {form: round(max(ms) - min(ms), 4) for form, ms in times.items()},
         "scatter_minus_gather_ms": round(med["scatter"] - med["gather"], 4)})


def kernel_table(case: str, inp: dict, grad_args: tuple[str, ...]) -> None:
    """(c): self CUDA time per kernel name (us) of one forward+backward of each setting."""
    from torch.profiler import ProfilerActivity, profile

    default = G.PERMUTE
    try:
        for form in G.PERMUTES:
            G.PERMUTE = form
            _, _, cot = forward_backward(G.moe_experts_grouped, inp, grad_args)  # warm
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                forward_backward(G.moe_experts_grouped, inp, grad_args, cot)
                torch.cuda.synchronize()
            kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
            kernels.sort(key=lambda e: -e.self_device_time_total)
            say({"case": case, "step": "profile", "permute": form,
                 "total_us": round(sum(e.self_device_time_total for e in kernels), 1),
                 "kernels": [{"name": e.key[:120], "calls": e.count,
                              "self_us": round(e.self_device_time_total, 1)} for e in kernels]})
    finally:
        G.PERMUTE = default


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("moe_probe.py: needs a CUDA device to time the kernels (torch.cuda."
                 "is_available() is False); nothing measured")
    import triton

    surface = default_catalog().surface("moe_experts")
    device = torch.device("cuda")
    say({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
         "triton": triton.__version__, "default_permute": G.PERMUTE})
    for case in CASES:
        gen = torch.Generator(device=device).manual_seed(0)
        inp = surface.make_inputs(surface.cases[case], torch.bfloat16, device, gen)
        say({"case": case, "spec": surface.cases[case]})
        permute_kernels(case, inp)
        end_to_end(case, inp, surface.grad_args)
        kernel_table(case, inp, surface.grad_args)
        dump()  # after each case: a run cut short keeps what it measured
        del inp
        torch.cuda.empty_cache()
    print(f"wrote {OUT / 'moe_probe.json'}", flush=True)


if __name__ == "__main__":
    main()
