"""Independent parts of a backward pass run side by side, on a second CUDA stream.

A backward pass often has two chains that need none of each other's results until the end:
the MoE's weight gradients (dw_out, dw_in) beside its input-gradient chain (d hidden, the
SwiGLU's backward, dx, the unpermute), Mamba-3's ``_bwd_dx`` beside ``_bwd_dqk`` and what
follows it. On one stream each kernel waits for the one before, and the GPU idles in their
tails and runs a memory-bound pass with its tensor cores unused; on two streams the hardware
may run blocks of both at once. The kernels and their inputs are the same, so the results
are the same bit for bit (tested on the GPU, eagerly and under CUDA-graph capture).

Usage (the rules that keep it safe with the caching allocator and under graph capture)::

    branch = Branch(device)
    out = torch.empty(...)          # 1. allocate what the branch writes BEFORE forking
    with branch.fork():             # 2. work issued here runs after everything issued so
        kernel(inputs, out)         #    far on the current stream, on the side stream
    ...                             #    (the current stream goes on meanwhile)
    branch.join()                   # 3. before ``out`` is read or anything is returned

The caller keeps every tensor the branch reads alive until ``join()`` (a local variable or
a saved tensor is enough: backward returns after it). No block is then ever allocated on
the side stream, so the allocator never hands memory the branch still uses to another
stream. Under capture (``torch.cuda.graph``) the fork and the join are the graph's edges.

On CPU (and with ``MEGACPP_SIDE_STREAM=0``, read at each ``Branch``) everything runs in
order on the current stream: ``fork()`` and ``join()`` do nothing.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

ENV = "MEGACPP_SIDE_STREAM"
# one side stream per device, made on first use; priority as torch.cuda.Stream takes it
# (lower is more urgent; 0 is the default streams' priority)
PRIORITY = 0
_SIDE: dict[tuple[int, int], torch.cuda.Stream] = {}


def enabled() -> bool:
    """Whether branches fork at all: ``MEGACPP_SIDE_STREAM`` unset or not ``0``."""
    return os.environ.get(ENV, "1") != "0"


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of a CUDA device (at ``PRIORITY``; one per device and priority)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, PRIORITY)
    if key not in _SIDE:
        _SIDE[key] = torch.cuda.Stream(device=index, priority=PRIORITY)
    return _SIDE[key]


class Branch:
    """A chain of work that may run beside the current stream's (see the module's rules).
    ``active`` is False on CPU, when the switch is off, or when the caller says so
    (``allow=False``: e.g. a branch whose work would allocate)."""

    def __init__(self, device: torch.device, allow: bool = True):
        self.active = allow and device.type == "cuda" and enabled()
        self._main = torch.cuda.current_stream(device) if self.active else None
        self._side = side_stream(device) if self.active else None

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Work issued inside runs on the side stream, after all work issued so far on the
        current stream. May be entered more than once; each entry waits for the current
        stream again."""
        if not self.active:
            yield
            return
        self._side.wait_stream(self._main)
        with torch.cuda.stream(self._side):
            yield

    def join(self) -> None:
        """The current stream waits for everything forked so far."""
        if self.active:
            self._main.wait_stream(self._side)
