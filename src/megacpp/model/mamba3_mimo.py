"""Mamba-3 MIMO mixer (pattern ``M:mimo``): the SISO mixer with rank-R B, C, x and z per head.

Follows ``mamba_ssm.modules.mamba3.Mamba3`` with ``is_mimo=True``: ``in_proj`` yields
``[z, x, B, C, dd_dt, dd_A, trap, angles]`` with B and C ``R * G * N`` wide (rank-major, as
mamba_ssm lays them out), B/C biases ``[H, R, N]``, and three per-channel projections
``mimo_x`` (x to its R inputs), ``mimo_z`` (z to its R gates) and ``mimo_o`` (the R outputs
back to one), each ``[H, R, P]``. The state stays ``[H, P, N]``: each token updates it with a
rank-R sum of outer products. With ``outproj_norm`` each of the R gated outputs is RMS-normed
per head (weight ``norm_weight``, shared by the ranks) before ``mimo_o`` sums them; the norm
comes after the gate, as in the SISO mixer. Equations: docs/mamba3.md, "MIMO".
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megacpp._compile import disable
from megacpp.errors import ConfigError
from megacpp.kernels.ops.mamba3_mimo_scan.reference import (
    flops_per_token as mimo_scan_flops_per_token,
)
from megacpp.kernels.ops.mamba3_mimo_scan.reference import (
    mamba3_mimo_scan_recurrent,
    zero_mimo_state,
)
from megacpp.kernels.ops.mamba3_scan.reference import Mamba3ScanState
from megacpp.kernels.recompute import recompute_in_backward
from megacpp.kernels.runtime import resolve
from megacpp.model.mamba3 import Mamba3Mixer

if TYPE_CHECKING:
    from megacpp.model.config import ModelConfig


class Mamba3MimoMixer(Mamba3Mixer):
    """Mamba-3 MIMO mixer over ``[B, L, d_model]``: :class:`Mamba3Mixer`'s arguments plus
    ``mimo_rank`` (R >= 1, the rank of each token's state update). ``chunk_size`` counts
    tokens: a chunk's score tile is (chunk_size * R)^2 (the config's ``mimo_chunk_size``)."""

    STEP_SURFACE = None  # no fused MIMO decode step: the paged step gathers, steps, scatters

    def __init__(self, d_model: int, *, mimo_rank: int = 4, d_state: int = 128, **kwargs) -> None:
        if not (isinstance(mimo_rank, int) and mimo_rank >= 1):
            raise ConfigError(f"Mamba3MimoMixer: mimo_rank must be a positive int, got "
                              f"{mimo_rank!r}")
        if isinstance(d_state, int) and d_state % 2:
            raise ConfigError(f"Mamba3MimoMixer: d_state must be even (dims i and i + N/2 "
                              f"rotate together), got {d_state}")
        super().__init__(d_model, d_state=d_state, **kwargs)
        self.mimo_rank = R = mimo_rank
        H, G, N, P = self.nheads, self.ngroups, self.d_state, self.headdim
        # the SISO layout widened: B and C carry R vectors per group, the biases one per rank
        self._split[2] = self._split[3] = R * G * N
        self.in_proj = nn.Linear(d_model, sum(self._split), bias=False)
        self.B_bias = nn.Parameter(torch.empty(H, R, N))
        self.C_bias = nn.Parameter(torch.empty(H, R, N))
        self.mimo_x = nn.Parameter(torch.empty(H, R, P))
        self.mimo_z = nn.Parameter(torch.empty(H, R, P))
        self.mimo_o = nn.Parameter(torch.empty(H, R, P))
        # per-channel scales (init 1/R, 1, 1/R), like D: no weight decay
        for p in (self.mimo_x, self.mimo_z, self.mimo_o):
            p._no_weight_decay = True  # type: ignore[attr-defined]
        self.reset_parameters()

    @classmethod
    def _config_kwargs(cls, cfg: ModelConfig) -> dict[str, Any]:
        """:meth:`Mamba3Mixer._config_kwargs` with the rank and the MIMO chunk size."""
        m = cfg.mamba
        return {**super()._config_kwargs(cfg), "mimo_rank": m.mimo_rank,
                "chunk_size": m.mimo_chunk_size}

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """:meth:`Mamba3Mixer.reset_parameters`, and mamba_ssm's MIMO init: mimo_x = mimo_o =
        1/R, mimo_z = 1 (every rank starts as the same copy of x, z and the output)."""
        super().reset_parameters()
        if hasattr(self, "mimo_x"):  # not yet during the SISO constructor
            self.mimo_x.fill_(1.0 / self.mimo_rank)
            self.mimo_z.fill_(1.0)
            self.mimo_o.fill_(1.0 / self.mimo_rank)

    def _chunked_scan(
        self, v: Tensor, cache: Mamba3ScanState | None, fresh: bool, continues: bool = False
    ) -> tuple[Callable[..., tuple[Tensor, Mamba3ScanState | None]], Mamba3ScanState | None]:
        """The catalog's backend (reference unless MEGACPP_KERNELS says so); both of ours
        continue from a cache (a prefill); ``fresh`` starts from the empty state unread. With
        ``outproj_norm`` the scan comes with the output norm and ``mimo_o`` sum applied
        (:meth:`_scan_and_norm`)."""
        scan = resolve("mamba3_mimo_scan", v).fn
        if self.outproj_norm:
            scan = functools.partial(self._scan_and_norm, scan)
        return scan, None if fresh else cache

    @disable  # a graph break under torch.compile: the scan is opaque there anyway
    def _scan_and_norm(
        self, scan: Callable[..., tuple[Tensor, Mamba3ScanState | None]], *,
        initial_state: Mamba3ScanState | None, **inputs: Tensor | int | bool | None,
    ) -> tuple[Tensor, Mamba3ScanState | None]:
        """``scan(**inputs)`` with its R outputs normed and summed (:meth:`_norm_and_sum`):
        y [B, L, H, P] and the final state. Under autograd the two keep only their inputs for
        backward and run again there (:func:`recompute_in_backward`): the scan's float32
        ``[B, L, R, H, P]`` intermediates, its per-rank output and the norm's float32 copies
        of it would otherwise stay alive from forward to backward (docs/mamba3.md, MIMO)."""
        names = [n for n, t in inputs.items() if isinstance(t, Tensor)]
        settings = {n: t for n, t in inputs.items() if not isinstance(t, Tensor)}
        state = () if initial_state is None else initial_state.tensors()

        def run(*tensors: Tensor | None) -> tuple[Tensor, ...]:
            scan_inputs, (norm_weight, mimo_o), state = (
                tensors[:len(names)], tensors[len(names):len(names) + 2], tensors[len(names) + 2:])
            y, final = scan(**dict(zip(names, scan_inputs, strict=True)), **settings,
                            initial_state=Mamba3ScanState(*state) if state else None)
            (y,) = self._norm_and_sum(y, norm_weight, mimo_o)
            return (y,) if final is None else (y, *final.tensors())

        y, *final = recompute_in_backward(run, *(inputs[n] for n in names), self.norm_weight,
                                          self.mimo_o, *state)
        return y, (Mamba3ScanState(*final) if final else None)

    def _recurrent_scan(
        self, **inputs: Tensor | Mamba3ScanState | None
    ) -> tuple[Tensor, Mamba3ScanState | None]:
        """The one-token scan :meth:`step` runs -> y [B, L, H, P]; with ``outproj_norm`` its
        R gated outputs normed and summed (:meth:`_norm_and_sum`), as :meth:`_chunked_scan`'s
        are."""
        y, final = mamba3_mimo_scan_recurrent(**inputs)
        if self.outproj_norm:  # y [B, L, R, H, P]
            (y,) = self._norm_and_sum(y, self.norm_weight, self.mimo_o)
        return y, final

    def _output(self, y: Tensor) -> Tensor:
        """out_proj of the scan output y [B, L, H, P] (both scans apply the output norm and
        the ``mimo_o`` sum themselves)."""
        return self.out_proj(y.flatten(2))  # [B, L, H, P] -> [B, L, d_model]

    def _norm_and_sum(self, y: Tensor, norm_weight: Tensor, mimo_o: Tensor) -> tuple[Tensor]:
        """The R gated outputs y [B, L, R, H, P], each RMS-normed per head and scaled by
        ``norm_weight`` (float32 math), summed with ``mimo_o``: ([B, L, H, P] in y.dtype,)."""
        f32 = torch.promote_types(y.dtype, torch.float32)
        weight = norm_weight.to(f32).view(self.nheads, self.headdim)
        normed = F.rms_norm(y.to(f32), (self.headdim,), eps=self.norm_eps) * weight
        return ((normed * mimo_o.to(f32).transpose(0, 1)).sum(2).to(y.dtype),)

    def _bc_shape(self) -> tuple[int, ...]:
        """(R, G, N): each token's R B / C vectors per group, rank-major (mamba_ssm's)."""
        return (self.mimo_rank, self.ngroups, self.d_state)

    def _scan_inputs(self, x: Tensor, again: tuple[Tensor, ...] = ()) -> dict[str, Tensor]:
        """:meth:`Mamba3Mixer._scan_inputs` (q, k [B, L, R, G, N]; the biases [H, R, N]) plus
        the MIMO projections; ``mimo_o`` only without ``outproj_norm`` (the norm sits between
        the scan's per-rank outputs and their sum)."""
        return {**super()._scan_inputs(x, again), "mimo_v": self.mimo_x,
                "mimo_z": self.mimo_z, "mimo_o": None if self.outproj_norm else self.mimo_o}

    def _zero_cache(
        self, batch_size: int, device: torch.device | str | None, dtype: torch.dtype
    ) -> Mamba3ScanState:
        """The zero MIMO state: k holds R keys per head, so the cache is
        B * H * (A + P*N + R*N + P) elements (:meth:`state_bytes`)."""
        return zero_mimo_state(
            batch_size, self.nheads, self.headdim, self.d_state, self.n_angles, self.mimo_rank,
            device=device, dtype=dtype,
        )

    def flops_per_token(self, seq_len: int) -> int:
        """Forward matmul FLOPs per token: projections + chunked MIMO scan (FlopCounterMode's
        count; the per-channel MIMO projections are elementwise)."""
        projections = 2 * self.d_model * (sum(self._split) + self.d_inner)
        H, P, N, R = self.nheads, self.headdim, self.d_state, self.mimo_rank
        return projections + mimo_scan_flops_per_token(seq_len, self.chunk_size, H, P, N, R)
