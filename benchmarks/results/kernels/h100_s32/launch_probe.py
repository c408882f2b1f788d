"""Session 32 probe: what one Triton launch and the MoE forward cost the host on this machine.

Prints: a pure-Python loop (the CPU's speed, to compare machines), a trivial Triton launch with
3 and with 15 arguments, ``torch.empty``, one aten op, each on an idle and on a busy GPU; then
cProfile of 30 MoE forwards (e64_k8) on an idle GPU, by internal time.

usage: python3 launch_probe.py
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import time

import torch
import triton
import triton.language as tl

from megacpp.kernels.registry import default_catalog


@triton.jit
def _noop(X, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(X + i, tl.load(X + i, mask=i < n), mask=i < n)


@triton.jit
def _noop15(X, A, B, C, D, E, F, G, a, b, c, d, e, f, n, BLOCK: tl.constexpr, K: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(X + i, tl.load(X + i, mask=i < n), mask=i < n)


def us(fn, mode, reps=50):
    for _ in range(3):
        fn()
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        if mode == "busy":
            torch.cuda._sleep(2_000_000)
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1e3)
    torch.cuda.synchronize()
    return statistics.median(out)


def main():
    t0 = time.perf_counter()
    s = 0
    for i in range(2_000_000):
        s += i
    print(f"python loop 2M adds: {(time.perf_counter() - t0) * 1e3:.1f} ms", flush=True)
    dev = torch.device("cuda")
    x = torch.zeros(1024, device=dev)
    rows = {
        "triton noop (3 args)": lambda: _noop[(1,)](x, 1024, BLOCK=1024),
        "triton noop (15 args)": lambda: _noop15[(1,)](x, x, x, x, x, x, x, x, 1, 2, 3, 4, 5, 6,
                                                      1024, BLOCK=1024, K=8, num_warps=4),
        "torch.empty": lambda: torch.empty(1 << 20, device=dev),
        "x.add_(1)": lambda: x.add_(1),
        "torch.cuda._sleep(1)": lambda: torch.cuda._sleep(1),
    }
    for name, fn in rows.items():
        print(f"{name:24s} idle {us(fn, 'idle'):7.1f} us   busy {us(fn, 'busy'):7.1f} us",
              flush=True)
    cat = default_catalog()
    surface = cat.surface("moe_experts")
    fn = cat.backend("moe_experts", "grouped_mm").fn
    gen = torch.Generator(device=dev).manual_seed(0)
    inp = surface.make_inputs(surface.cases["e64_k8"], torch.bfloat16, dev, gen)
    for _ in range(3):
        fn(**inp)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    for _ in range(30):
        torch.cuda.synchronize()
        prof.enable()
        fn(**inp)
        prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
