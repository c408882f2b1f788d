"""``resolve`` under torch.compile: a first selection inside a compiled region must not make
dynamo trace the catalog's construction (it ignores ``functools.cache`` and would break the
graph at every backend's ``torch.compiler.disable`` and compile each lazily imported callable
as a frame of its own; with more than 8 such rows that hit dynamo's recompile limit)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.kernels.interpreter import ROOT

CHILD = r"""
import warnings
import torch
from torch._dynamo.utils import counters
from megacpp.kernels.runtime import clear_resolutions, resolve

weight = torch.ones(8)

def norm_twice(x):
    y = resolve("rmsnorm", x).fn(x, weight, None, 1e-5, None, False)[0]
    return y * 2

clear_resolutions()  # the first selection happens while dynamo traces
x = torch.randn(4, 8)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = torch.compile(norm_twice, backend="eager")(x)
torch.testing.assert_close(out, norm_twice(x))
print("lru_cache warnings:", sum("lru_cache" in str(w.message) for w in caught))
print("frames:", counters["frames"]["total"])
print("breaks:", sum(counters["graph_break"].values()))
"""


def test_first_selection_under_compile_does_not_trace_the_catalog() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    env.pop("MEGACPP_KERNELS", None)  # the reference mode: runs on CPU
    run = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         timeout=300, env=env, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = dict(line.split(": ") for line in run.stdout.strip().splitlines())
    assert lines["lru_cache warnings"] == "0", run.stdout
    # the break at the selection, seen from the function and from resolve's own frame (the
    # catalog traced: 37 frames and 10 breaks for this one call, torch 2.13)
    assert int(lines["frames"]) <= 4 and int(lines["breaks"]) <= 2, run.stdout
