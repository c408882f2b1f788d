"""Session 32 probe: is the host slower right after waiting on the GPU?

Times a fixed piece of host work -- pure Python (sizes as plan_triton computes them, 200
times) and one Triton noop launch plus a torch.empty -- right after each kind of wait:
nothing (back to back), a blocking ``torch.cuda.synchronize()`` on a GPU busy for ~2 ms,
``time.sleep(2 ms)``, and a Python spin that polls ``event.query()`` until the same busy GPU
is done. Median of 50 each.

usage: python3 cold_host_probe.py
"""

from __future__ import annotations

import statistics
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _noop(X, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(X + i, tl.load(X + i, mask=i < n), mask=i < n)


def py_work():
    for n in range(200):
        e_pad = max(16, triton.next_power_of_2(64 + n))
        min(1024, max(16, 8192 // e_pad))
        triton.cdiv(131072 + n, 1024)


def main():
    x = torch.zeros(1024, device="cuda")

    def gpu_work():
        _noop[(1,)](x, 1024, BLOCK=1024)
        torch.empty(1 << 20, device="cuda")

    def spin_wait():
        ev = torch.cuda.Event()
        ev.record()
        while not ev.query():
            pass

    waits = {
        "back to back": lambda: None,
        "cuda.synchronize (GPU busy 2 ms)": lambda: (torch.cuda._sleep(2_000_000),
                                                     torch.cuda.synchronize()),
        "time.sleep(2 ms)": lambda: time.sleep(0.002),
        "spin on event.query (GPU busy 2 ms)": lambda: (torch.cuda._sleep(2_000_000),
                                                        spin_wait()),
    }
    for work_name, work in (("python sizes x200", py_work), ("noop launch + empty", gpu_work)):
        for _ in range(5):
            work()
        for wait_name, wait in waits.items():
            out = []
            for _ in range(50):
                wait()
                t0 = time.perf_counter_ns()
                work()
                out.append((time.perf_counter_ns() - t0) / 1e3)
            torch.cuda.synchronize()
            print(f"{work_name:22s} after {wait_name:38s} {statistics.median(out):8.1f} us",
                  flush=True)


if __name__ == "__main__":
    main()
