"""Thin adapters to peer (donor) implementations; each imports its peer package only when a
donor row is run (the registry imports this module for :func:`fla_check_guard`).

They adapt call conventions to the surface contracts; none of them is on the training path.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from megacpp.contract.versions import version_tuple
from megacpp.kernels.catalog import BackendUnsupported, DeviceFacts
from megacpp.kernels.ops.rmsnorm.reference import rmsnorm_reference
from megacpp.kernels.ops.short_conv.reference import short_conv_reference


@functools.cache
def _compiled(reference: Any) -> Any:
    """torch.compile of a surface's reference, built once per reference."""
    return torch.compile(reference, dynamic=False)


def rmsnorm_compiled(
    x: Tensor, weight: Tensor, residual: Tensor | None = None, eps: float = 1e-5,
    out_dtype: torch.dtype | None = None, skip: bool = False, fanout: int = 1,
    rope: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, ...]:
    """torch.compile of the reference (inductor generates one fused Triton kernel each way)."""
    return _compiled(rmsnorm_reference)(x, weight, residual, eps, out_dtype, skip, fanout, rope)


def short_conv_compiled(x: Tensor, weight: Tensor, doc_ids: Tensor | None = None) -> Tensor:
    """torch.compile of the reference: what the R mixer ran under a compiled model before the
    Triton kernel (Inductor fuses the taps, masks and SiLU into a few Triton kernels)."""
    return _compiled(short_conv_reference)(x, weight, doc_ids)


def liger_linear_cross_entropy(
    h: Tensor, weight: Tensor, labels: Tensor, ignore_index: int = -100,
    accum_dtype: torch.dtype | None = torch.float32,
) -> Tensor:
    """Liger-kernel's fused linear cross-entropy (mean reduction)."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(
        h, weight, labels, ignore_index=ignore_index, accum_dtype=accum_dtype
    )


def _mamba3_siso_module() -> Any:
    """mamba_ssm's ``mamba3_siso_combined`` module (:func:`_mamba_ssm_module`)."""
    return _mamba_ssm_module("mamba_ssm.ops.triton.mamba3.mamba3_siso_combined")


def _mamba_ssm_module(name: str) -> Any:
    """A module of mamba_ssm, imported without the package ``__init__``.

    ``mamba_ssm/__init__.py`` imports its CUDA extensions (``selective_scan_cuda``), which a
    pure-Python wheel (``MAMBA_SKIP_CUDA_BUILD=TRUE``) lacks. The Mamba-3 ops are plain
    Triton / TileLang, so a bare package module pointing at the installed folder stands in for
    the ``__init__`` (a ``sys.modules`` entry; no library file is changed)."""
    import importlib
    import importlib.util
    import sys
    import types

    if "mamba_ssm" not in sys.modules:
        spec = importlib.util.find_spec("mamba_ssm")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("mamba_ssm is not installed")
        package = types.ModuleType("mamba_ssm")
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec
        sys.modules["mamba_ssm"] = package
    return importlib.import_module(name)


def mamba3_siso_combined(
    q: Tensor, k: Tensor, v: Tensor, adt: Tensor, dt: Tensor, trap: Tensor,
    q_bias: Tensor, k_bias: Tensor, angles: Tensor,
    D: Tensor | None = None, z: Tensor | None = None, reset: Tensor | None = None,
    initial_state: Any = None, chunk_size: int = 64, output_final_state: bool = True,
) -> Tensor:
    """mamba_ssm's Mamba-3 SISO Triton op on the ``mamba3_scan`` surface's arguments -> y
    (it returns no final state whatever ``output_final_state`` says). Per-head scalars go to
    its [B, H, L] layout.

    Packed documents (``reset``) are refused (:class:`BackendUnsupported`). Its varlen form,
    the rows cut into sequences at every document start (``cu_seqlens``), did not give this
    surface's function on an H100: 10-21% relative error against the float64 reference, and
    NaN at the end of some documents, while the same inputs without documents agreed to 3e-3.
    Whether its varlen path or that adaptation is at fault was not settled. The bench cases
    have no documents."""
    if reset is not None and bool(reset.any()):
        raise BackendUnsupported(
            "mamba_ssm is measured without packed documents: its varlen form gave 10-21% "
            "relative error and NaN against this surface's reference on an H100")
    peer = _mamba3_siso_module().mamba3_siso_combined
    states = None if initial_state is None else initial_state.tensors()
    return peer(q, k, v, adt.transpose(1, 2).contiguous(), dt.transpose(1, 2).contiguous(),
                trap.transpose(1, 2).contiguous(), q_bias, k_bias, angles, D, z,
                Input_States=states, chunk_size=chunk_size)


def mamba3_mimo_tilelang(
    q: Tensor, k: Tensor, v: Tensor, adt: Tensor, dt: Tensor, trap: Tensor,
    q_bias: Tensor, k_bias: Tensor, mimo_v: Tensor, angles: Tensor,
    mimo_z: Tensor | None = None, mimo_o: Tensor | None = None,
    D: Tensor | None = None, z: Tensor | None = None, reset: Tensor | None = None,
    initial_state: Any = None, chunk_size: int = 16, output_final_state: bool = True,
) -> Tensor:
    """mamba_ssm's Mamba-3 MIMO TileLang op (``mamba3_mimo``) on the ``mamba3_mimo_scan``
    surface's arguments -> y (no final state whatever ``output_final_state`` says). Per-head
    scalars go to its [B, H, L] layout, angles to float32 (as its Mamba3 module passes them);
    its ``rotary_dim_divisor`` is N / A (2 or 4: it rotates half or all of the N dims).

    Refused (:class:`BackendUnsupported`): packed documents (it has no per-token reset), an
    initial state (it takes none), and an A other than N/4 or N/2."""
    if reset is not None and bool(reset.any()):
        raise BackendUnsupported("mamba_ssm's mamba3_mimo has no packed-document reset")
    if initial_state is not None:
        raise BackendUnsupported("mamba_ssm's mamba3_mimo takes no initial state")
    d_state, n_angles = q.shape[-1], angles.shape[-1]
    divisor = d_state // n_angles
    if divisor * n_angles != d_state or divisor not in (2, 4):
        raise BackendUnsupported(f"mamba_ssm's mamba3_mimo rotates N/2 or N/4 pairs; got "
                                 f"{n_angles} of d_state {d_state}")
    peer = _mamba_ssm_module("mamba_ssm.ops.tilelang.mamba3.mamba3_mimo").mamba3_mimo
    return peer(
        Q=q, K=k, V=v, ADT=adt.transpose(1, 2).contiguous(), DT=dt.transpose(1, 2).contiguous(),
        Trap=trap.transpose(1, 2).contiguous(), Q_bias=q_bias, K_bias=k_bias, MIMO_V=mimo_v,
        MIMO_Z=mimo_z, MIMO_Out=mimo_o, Angles=angles.float(), D=D, Z=z, chunk_size=chunk_size,
        rotary_dim_divisor=divisor, dtype=v.dtype,
    )


def _version(package: str) -> tuple[int, ...] | None:
    """The installed distribution's version as numbers (``3.6.0`` -> (3, 6, 0)), or None: the
    environment contract's reading of it."""
    from megacpp.contract.fingerprint import package_versions  # (not at the registry's import)

    return version_tuple(package_versions([package])[package], 3)


def fla_check_guard(facts: DeviceFacts) -> str | None:
    """Why ``kernels check`` cannot run fla's gated delta rule here: fla refuses its gated
    backward on Hopper with Triton 3.4.0 up to 3.7.1 (``chunk_bwd_dqkwg`` is miscompiled, fla
    issue 640). :func:`fla_chunk_gated_delta_rule` lifts that guard so the bench can time it,
    but its gradients cannot be checked: on an H100 with Triton 3.6 the check case faulted with
    an illegal memory access."""
    triton = _version("triton")
    hopper = facts.type == "cuda" and facts.capability is not None and facts.capability[0] == 9
    if hopper and triton is not None and (3, 4, 0) <= triton < (3, 7, 1):
        return ("fla refuses its gated backward on Hopper with Triton 3.4.0-3.7.0 (a miscompile, "
                f"fla issue 640; this Triton is {'.'.join(map(str, triton))}); the bench times "
                "it with the guard lifted, its gradients are not checkable here")
    return None


def fla_chunk_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float | None = None,
    initial_state: Tensor | None = None, reset: Tensor | None = None,
    output_final_state: bool = True, chunk_size: int = 64,
) -> tuple[Tensor, Tensor | None]:
    """fla's ``chunk_gated_delta_rule`` under the gated_delta surface contract.

    Same layout ([B, L, H, D], state [B, H, K, V]). Document resets become fla's varlen form:
    the rows are flattened into one and cut at every row start and reset (``cu_seqlens``);
    row b's initial state seeds its first document unless that document starts with a reset,
    and row b's final state is its last document's. fla always runs 64-token chunks here.

    fla >= 0.5 refuses its gated backward on Hopper with Triton 3.4-3.7.0 (a Triton miscompile
    of ``chunk_bwd_dqkwg``, fla issue 640; this project's GPU stack has Triton 3.6). The peer
    is measured for speed, so the guard is lifted here, and its gradients on that stack are not
    to be trusted: ``kernels check`` skips the row there (:func:`fla_check_guard`), since its
    check case (K = 32, documents) faulted with an illegal memory access on an H100.
    """
    import fla.ops.common.chunk_o as fla_chunk_o
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    fla_chunk_o.TRITON_ABOVE_3_7_1 = True  # lift the guard (see above); speed bar only

    if reset is None:
        return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale,
                                      initial_state=initial_state,
                                      output_final_state=output_final_state)
    B, L, H, K = q.shape
    starts = reset.clone()
    starts[:, 0] = True
    first = starts.flatten().nonzero().flatten()  # [S] flat index of every document start
    cu_seqlens = torch.cat([first, first.new_tensor([B * L])])
    docs_per_row = starts.sum(1)  # [B]
    first_doc = torch.cumsum(docs_per_row, 0) - docs_per_row  # [B] sequence index of row starts
    h0 = None
    if initial_state is not None:
        carried = initial_state * (~reset[:, 0]).to(initial_state.dtype)[:, None, None, None]
        h0 = initial_state.new_zeros(first.numel(), H, K, v.shape[-1])
        h0 = h0.index_copy(0, first_doc, carried)
    o, state = chunk_gated_delta_rule(
        *(x.flatten(0, 1)[None] for x in (q, k, v, g, beta)), scale=scale, initial_state=h0,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    if state is not None:
        state = state.index_select(0, first_doc + docs_per_row - 1)  # each row's last document
    return o.view(B, L, H, -1), state
