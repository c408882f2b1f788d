"""Loop bounds shared by the MoE kernels under CUDA and the CPU interpreter."""

from __future__ import annotations

import os

import triton
import triton.language as tl


def _const(n: int) -> int:
    """A loop bound as a constexpr under the CPU interpreter (whose runtime scalars cannot bound
    a Python range under numpy 2), else 0: the kernel then loops to the runtime value."""
    return n if os.environ.get("TRITON_INTERPRET") == "1" else 0


@triton.jit
def _bound(n, N_CONST: tl.constexpr):
    if N_CONST > 0:
        return N_CONST
    else:
        return n
