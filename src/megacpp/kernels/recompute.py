"""Recompute in backward instead of saving: a function's inputs are all autograd keeps.

``recompute_in_backward(fn, *inputs)`` runs ``fn`` without building a graph, saves only its
tensor inputs and, in backward, runs ``fn`` again under the forward's autocast state to
differentiate it. Activation checkpointing for one op, hand-written because
``torch.utils.checkpoint`` does not fit: its non-reentrant form keeps the inputs outside
autograd's saved tensors (so ``saved_tensor_bytes`` could not count them) and its reentrant
form refuses ``torch.autograd.grad``. :func:`saved_tensor_bytes` measures what a forward
keeps for backward, on any device.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from megacpp._compile import disable

_AUTOCAST_DEVICES = ("cpu", "cuda")
_replay = threading.local()  # .active: a backward is re-running some fn on this thread


@disable
def recompute_in_backward(fn: Callable[..., tuple[Tensor, ...]], *inputs: Tensor | None
                          ) -> tuple[Tensor, ...]:
    """``fn(*inputs)`` (a tuple of tensors; ``inputs`` are tensors or None), keeping only
    ``inputs`` for backward. A plain call without grad mode, without an input that needs a
    gradient, or inside another recomputation's re-run (that one already keeps only its own
    inputs; nesting would recompute ``fn`` twice). ``fn`` must be deterministic: backward
    differentiates a second run of it. Opaque to torch.compile (a graph break; the backward
    calls ``torch.autograd.grad``, which dynamo does not trace)."""
    needs_grad = any(t is not None and t.requires_grad for t in inputs)
    if not (torch.is_grad_enabled() and needs_grad) or getattr(_replay, "active", False):
        return fn(*inputs)
    return _Recompute.apply(fn, *inputs)


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, *inputs):
        ctx.fn = fn
        ctx.autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                        for d in _AUTOCAST_DEVICES]
        ctx.save_for_backward(*inputs)
        outputs = fn(*inputs)  # grad mode is off inside an autograd.Function's forward
        ctx.mark_non_differentiable(*(o for o in outputs if not o.is_floating_point()))
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        inputs = [None if t is None else t.detach().requires_grad_(needs)
                  for t, needs in zip(ctx.saved_tensors, ctx.needs_input_grad[1:], strict=True)]
        _replay.active = True
        try:
            with torch.enable_grad(), _autocast(ctx.autocast):
                outputs = ctx.fn(*inputs)
        finally:
            _replay.active = False
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs, strict=True)
                 if g is not None and o.requires_grad]
        wanted = [t for t in inputs if t is not None and t.requires_grad]
        grads = iter(torch.autograd.grad([o for o, _ in pairs], wanted,
                                         [g for _, g in pairs], allow_unused=True)
                     if pairs else [None] * len(wanted))
        return None, *(next(grads) if t is not None and t.requires_grad else None
                       for t in inputs)


@contextmanager
def _autocast(states: list[tuple[str, bool, torch.dtype]]) -> Iterator[None]:
    """Re-enter the forward's autocast state on each device type (backward runs without)."""
    with torch.autocast("cpu", dtype=states[0][2], enabled=states[0][1]), \
            torch.autocast("cuda", dtype=states[1][2], enabled=states[1][1]):
        yield


@contextmanager
def saved_tensor_bytes(exclude: tuple[Tensor, ...] = ()) -> Iterator[dict[str, int]]:
    """Count what autograd saves for backward inside the block: ``{"bytes": ..., "tensors":
    ...}``, each storage once (views of one storage share it) and ``exclude`` (parameters,
    leaf inputs: alive anyway) not at all. Filled in as the block runs."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: set[int] = set()
    result = {"bytes": 0, "tensors": 0}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in skip and key not in seen and storage.nbytes() > 0:
            seen.add(key)
            result["bytes"] += storage.nbytes()
            result["tensors"] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield result
