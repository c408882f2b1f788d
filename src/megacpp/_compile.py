"""torch.compile markers that cost nothing at import.

``torch.compiler.disable`` and ``torch.compiler.assume_constant_result`` import torch._dynamo
(seconds of CPU) the moment they decorate. The model's layers and the kernel catalog are
imported by every command, ``megacpp model describe`` included, so they mark functions with
these instead. tests/test_compile_markers.py checks that they do what torch's do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def disable(fn: F) -> F:
    """``torch.compiler.disable(fn)``, made on ``fn``'s first call: PyTorch's own lazy form
    (its optimizers use it). Dynamo skips the wrapper's module, so under tracing a call is a
    graph break and ``fn`` runs uncompiled, as with ``torch.compiler.disable``."""
    return torch._disable_dynamo(fn)


def assume_constant_result(fn: F) -> F:
    """``torch.compiler.assume_constant_result(fn)``: the mark it sets on ``fn``."""
    fn._dynamo_marked_constant = True
    return fn
