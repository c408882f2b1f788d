"""Where a step's GPU time goes: profiler kernels grouped into families.

A family is either one of our ops (its Triton kernels, found by name in the modules of
``megacpp.kernels.ops.<surface>``, so a new kernel is counted without a list to update) or a
kind of library kernel recognised by its name (cuBLAS / CUTLASS GEMMs, grouped GEMMs,
attention, the optimizer, Inductor's generated kernels, PyTorch's elementwise and reduction
kernels, copies). :func:`family_breakdown` takes ``(name, device us)`` pairs, e.g.
the CUDA rows of ``torch.profiler``'s ``key_averages()``, which also covers the kernels a
replayed CUDA graph runs.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import re
from collections.abc import Callable, Iterable

# library kernels by name, first match wins (attention before GEMM: cuDNN's attention kernels
# carry "wgmma"/"gemm"-like tile names too)
LIBRARY_FAMILIES: tuple[tuple[str, str], ...] = (
    ("attention (flash / cuDNN SDPA)", r"flash|fmha|sdpa|attention"),
    ("grouped GEMM", r"group.*(gemm|mm)|(gemm|mm).*group"),
    ("GEMM (cuBLAS / CUTLASS)", r"nvjet|gemm|cutlass|xmma|cublas|magma|s\d+_.*tensorop"),
    ("optimizer", r"adam|multi_tensor|foreach|muon"),
    ("Inductor (torch.compile)", r"^triton_(poi|red|per|tem|for)_"),
    ("copies and fills", r"^memcpy|^memset|copy_kernel|catarray|fillfunctor"),
    ("torch elementwise / reductions", (r"elementwise|reduce_kernel|scan|index|gather|scatter"
                                        r"|softmax|norm|sort|radix|cub::")),
)


def device_rows(averages: Iterable) -> list:
    """The device rows (kernels, copies, memsets) of a ``torch.profiler`` ``key_averages()``:
    the CPU ops beside them carry their kernels' device time too, so sums over all rows count
    it twice."""
    return [e for e in averages if e.device_type.name == "CUDA"]


def kernel_times_us(fn: Callable[[], object], calls: int = 10) -> dict[str, float]:
    """GPU time per call of each kernel ``fn`` runs (CUDA only): ``fn`` once to warm up (its
    compiles and autotuning stay out), then ``calls`` times under ``torch.profiler``; name ->
    device us per call, largest first. A replayed CUDA graph's kernels are counted too."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for e in device_rows(prof.key_averages()):
        totals[e.key] = totals.get(e.key, 0.0) + e.device_time_total / calls
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


@functools.cache
def our_kernels() -> dict[str, str]:
    """Triton kernel name -> its op (``mamba3_scan``, ``linear_cross_entropy``, ...) for every
    JIT function defined in ``megacpp.kernels.ops.<surface>`` (any of its modules) and in the
    shared kernel modules beside them (``megacpp.kernels.ops.sum_rows``); a name defined by two
    ops is left out: it could be either. Empty without triton."""
    try:
        import triton
    except ImportError:
        return {}
    from megacpp.kernels import ops

    owners: dict[str, set[str]] = {}
    for info in pkgutil.walk_packages(ops.__path__, prefix=f"{ops.__name__}."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # a module whose optional dependency is missing
            continue
        for name, obj in vars(module).items():
            if isinstance(obj, triton.runtime.JITFunction) and obj.fn.__module__ == info.name:
                op = info.name.removeprefix(f"{ops.__name__}.").split(".")[0]
                owners.setdefault(name, set()).add(op)
    return {name: next(iter(s)) for name, s in owners.items() if len(s) == 1}


def kernel_family(name: str, ours: dict[str, str] | None = None) -> str:
    """The family of one profiler kernel name (``ours``: :func:`our_kernels` by default)."""
    ours = our_kernels() if ours is None else ours
    if name in ours:
        return f"ours: {ours[name]}"
    low = name.lower()
    for family, pattern in LIBRARY_FAMILIES:
        if re.search(pattern, low):
            return family
    return "other"


def family_breakdown(kernels: Iterable[tuple[str, float]], steps: int = 1,
                     ours: dict[str, str] | None = None, top: int = 3) -> list[dict]:
    """``(name, device us)`` pairs -> one row per family, largest first: ms per step, share of
    the total, and its ``top`` kernels (name, ms per step)."""
    totals: dict[str, float] = {}
    members: dict[str, dict[str, float]] = {}
    for name, us in kernels:
        family = kernel_family(name, ours)
        totals[family] = totals.get(family, 0.0) + us
        members.setdefault(family, {})
        members[family][name] = members[family].get(name, 0.0) + us
    whole = sum(totals.values()) or 1.0
    rows = []
    for family, us in sorted(totals.items(), key=lambda kv: -kv[1]):
        biggest = sorted(members[family].items(), key=lambda kv: -kv[1])[:top]
        rows.append({"family": family, "ms_per_step": us / steps / 1e3, "share": us / whole,
                     "top": [(n, u / steps / 1e3) for n, u in biggest]})
    return rows


def format_breakdown(rows: list[dict]) -> str:
    """A plain-text table of :func:`family_breakdown` rows."""
    total = sum(r["ms_per_step"] for r in rows)
    lines = [f"{'family':<36} {'ms/step':>9} {'share':>7}  largest kernels (ms/step)"]
    for r in rows:
        top = ", ".join(f"{n[:48]} {ms:.2f}" for n, ms in r["top"])
        lines.append(f"{r['family']:<36} {r['ms_per_step']:9.2f} {100 * r['share']:6.1f}%  {top}")
    lines.append(f"{'total GPU kernel time':<36} {total:9.2f}")
    return "\n".join(lines)
