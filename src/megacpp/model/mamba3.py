"""Mamba-3 SISO mixer (pattern letter ``M``): in_proj -> Mamba-3 scan -> out_proj.

Follows ``mamba_ssm.modules.mamba3.Mamba3`` (SISO): one ``in_proj`` yields ``[z, x, B, C,
dd_dt, dd_A, trap, angles]``; dt = softplus(dd_dt + dt_bias); A = -softplus(dd_A) <= -A_floor
is data-dependent per token and head; B and C are RMS-normed per group, then biased and
rotated per head inside the scan; there is no conv1d. The output projected by ``out_proj`` is
``rms_norm((y + D x) * silu(z))``, normed per head (Mamba-2's gated RMSNorm with the gate
first, group size headdim), or ``(y + D x) * silu(z)`` with ``outproj_norm=False``. The mixer
has no pre-norm and no residual: the block wrapper does ``x + mixer(norm(x))``. Equations:
docs/mamba3.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megacpp.errors import ConfigError
from megacpp.kernels.ops.float8_linear.torchao_float8 import linear_rows
from megacpp.kernels.ops.mamba3_scan.reference import (
    Mamba3ScanState,
    mamba3_scan_chunked,
    mamba3_scan_recurrent,
    zero_scan_state,
)
from megacpp.kernels.ops.mamba3_scan.reference import (
    flops_per_token as scan_flops_per_token,
)
from megacpp.kernels.runtime import resolve
from megacpp.model.mixer import RecurrentMixer
from megacpp.model.norm import RMSNorm

if TYPE_CHECKING:
    from megacpp.model.config import ModelConfig

_CACHE_DTYPES = (torch.float32, torch.float64)


class Mamba3Mixer(RecurrentMixer):
    """Mamba-3 SISO mixer over ``[B, L, d_model]``.

    Args:
        d_model: model width.
        d_state: N, state size per head (also the width of B and C).
        headdim: P, channels of x per head; nheads = expand * d_model // headdim.
        expand: d_inner = expand * d_model.
        ngroups: groups of B/C shared by nheads // ngroups heads each.
        chunk_size: chunk length of the chunked scan used by ``forward``.
        rope_fraction: fraction of the N state dims that are rotated (in pairs).
        dt_min, dt_max, dt_init_floor: dt_bias init, dt ~ log-uniform[dt_min, dt_max] at init.
        A_floor: A = -softplus(dd_A) is clamped to at most -A_floor.
        outproj_norm: RMS-norm the gated scan output per head (weight ``norm_weight``
            [d_inner]). Without it nothing bounds the output: when A*dt nears 0 the state sums
            thousands of dt-weighted inputs.
        norm_eps: eps of the B, C and output RMSNorms.
        init_std: std of the normal init of in_proj and out_proj weights.
    """

    def __init__(
        self,
        d_model: int,
        d_state: int = 128,
        headdim: int = 64,
        expand: int = 2,
        ngroups: int = 1,
        chunk_size: int = 64,
        rope_fraction: float = 0.5,
        dt_min: float = 1e-3,
        dt_max: float = 1e-1,
        dt_init_floor: float = 1e-4,
        A_floor: float = 1e-4,
        outproj_norm: bool = True,
        norm_eps: float = 1e-5,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.d_model, self.d_state, self.headdim, self.ngroups = d_model, d_state, headdim, ngroups
        self.d_inner = int(expand * d_model)
        self.chunk_size = chunk_size
        self.n_angles = int(d_state * rope_fraction) // 2  # R rotated pairs
        self.dt_min, self.dt_max, self.dt_init_floor = dt_min, dt_max, dt_init_floor
        self.A_floor, self.init_std = A_floor, init_std
        self.outproj_norm, self.norm_eps = bool(outproj_norm), norm_eps
        self._validate(rope_fraction)
        self.nheads = self.d_inner // headdim
        H, G, N = self.nheads, ngroups, d_state

        # in_proj order (mamba_ssm's): [z, x, B, C, dd_dt, dd_A, trap, angles]
        self._split = [self.d_inner, self.d_inner, G * N, G * N, H, H, H, self.n_angles]
        self.in_proj = nn.Linear(d_model, sum(self._split), bias=False)
        self.dt_bias = nn.Parameter(torch.empty(H))
        self.B_bias = nn.Parameter(torch.empty(H, N))
        self.C_bias = nn.Parameter(torch.empty(H, N))
        # float32 math on the bf16 projections (torch's nn.RMSNorm with a float32 weight and
        # bf16 input falls back to its unfused composite); the catalog's kernel when chosen
        self.B_norm = RMSNorm(N, norm_eps)
        self.C_norm = RMSNorm(N, norm_eps)
        self.D = nn.Parameter(torch.empty(H))
        # the output norm's weight (mamba_ssm's RMSNormGated, group_size = headdim)
        self.norm_weight = nn.Parameter(torch.empty(self.d_inner)) if self.outproj_norm else None
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=False)
        self.dt_bias._no_weight_decay = True  # type: ignore[attr-defined]
        self.D._no_weight_decay = True  # type: ignore[attr-defined]
        self.reset_parameters()

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> Mamba3Mixer:
        return cls(**cls._config_kwargs(cfg))

    @classmethod
    def _config_kwargs(cls, cfg: ModelConfig) -> dict[str, Any]:
        """The constructor's keyword arguments from the config's model and ``[mamba]`` fields."""
        m = cfg.mamba
        return {
            "d_model": cfg.d_model,
            "d_state": m.d_state,
            "headdim": m.headdim,
            "expand": m.expand,
            "ngroups": m.ngroups,
            "chunk_size": m.chunk_size,
            "rope_fraction": m.rope_fraction,
            "outproj_norm": m.outproj_norm,
            "norm_eps": cfg.norm_eps,
            "init_std": cfg.init_std,
        }

    def _validate(self, rope_fraction: float) -> None:
        for name in ("d_model", "d_state", "headdim", "ngroups", "chunk_size"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value > 0):
                raise ConfigError(f"Mamba3Mixer: {name} must be a positive int, got {value!r}")
        nheads, rem = divmod(self.d_inner, self.headdim)
        if rem:
            raise ConfigError(
                f"Mamba3Mixer: d_inner = expand * d_model = {self.d_inner} must be a multiple "
                f"of headdim ({self.headdim})"
            )
        if nheads % self.ngroups:
            raise ConfigError(
                f"Mamba3Mixer: nheads ({nheads}) must be a multiple of ngroups ({self.ngroups})"
            )
        if not (0 < rope_fraction <= 1 and self.n_angles >= 1):
            raise ConfigError(
                f"Mamba3Mixer: rope_fraction must be in (0, 1] and rotate at least one pair of "
                f"the {self.d_state} state dims, got {rope_fraction}"
            )
        if not 0 < self.dt_min <= self.dt_max:
            raise ConfigError(
                f"Mamba3Mixer: need 0 < dt_min <= dt_max, got {self.dt_min}, {self.dt_max}"
            )
        if self.A_floor <= 0:
            raise ConfigError(f"Mamba3Mixer: A_floor must be > 0, got {self.A_floor}")

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """mamba_ssm's init, with normal(0, init_std) projections."""
        nn.init.normal_(self.in_proj.weight, std=self.init_std)
        nn.init.normal_(self.out_proj.weight, std=self.init_std)
        log_dt = torch.empty_like(self.dt_bias)
        log_dt.uniform_(math.log(self.dt_min), math.log(self.dt_max))
        dt = log_dt.exp().clamp(min=self.dt_init_floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        self.B_bias.fill_(1.0)
        self.C_bias.fill_(1.0)
        self.D.fill_(1.0)
        if self.norm_weight is not None:
            self.norm_weight.fill_(1.0)
        self.B_norm.reset_parameters()
        self.C_norm.reset_parameters()

    # the pre-norm block hands x in three times (Block, RMSNorm.with_skip's fanout): in_proj's
    # three GEMMs (see _project) read one copy each, and the norm's backward kernel sums their
    # three input gradients (autograd's add of them was an Inductor kernel of its own reading
    # three [T, d_model] products: 0.47 ms of the nam56r-350m step on an H100, 14 layers)
    INPUT_FANOUT = 3

    #: The catalog surface of the fused paged decode step (None: the reference's
    #: gather / :meth:`step` / scatter always)
    STEP_SURFACE: ClassVar[str | None] = "mamba3_step"

    def forward(
        self, x: Tensor, doc_ids: Tensor | None = None, again: tuple[Tensor, ...] = (),
        cache: Mamba3ScanState | None = None, fresh: bool = False,
        last_index: Tensor | None = None, continues: bool = False,
    ) -> Tensor:
        """Chunked scan over x [B, L, d_model] -> [B, L, d_model].

        doc_ids: [B, L] integer document index per token of a packed row; a change from
            t-1 to t starts a new document at t (state and trapezoid term are dropped).
        cache: continue from its state and write the final state back into it (prefill). The
            first token continues the cached sequence (no reset at t = 0).
        fresh: start from the empty state without reading or checking ``cache`` (which only
            receives the final state): no host sync, so a first prefill chunk can be captured.
        again: up to two more tensors with x's values, read by in_proj's second and third
            GEMMs (default x).
        last_index: [B] each row's last real token; the tokens after it (right padding)
            leave the state as it was (:func:`hold_state_after`).
        continues: continue from ``cache`` without checking it for zeros (no host sync: a
            continuation chunk can be captured).
        """
        reset = None if doc_ids is None else _doc_starts(doc_ids, x.shape[:2])
        inputs = self._scan_inputs(x, again)
        if last_index is not None:
            inputs = hold_state_after(inputs, last_index)
        scan, initial = self._chunked_scan(inputs["v"], cache, fresh, continues)
        y, final = scan(**inputs, reset=reset, initial_state=initial, chunk_size=self.chunk_size,
                        output_final_state=cache is not None)
        if cache is not None:
            cache.update_(final)
        return self._output(y)

    def _chunked_scan(
        self, v: Tensor, cache: Mamba3ScanState | None, fresh: bool, continues: bool = False
    ) -> tuple[Callable[..., tuple[Tensor, Mamba3ScanState | None]], Mamba3ScanState | None]:
        """The chunked scan :meth:`forward` runs on v [B, L, H, P], and the state it starts from.

        The catalog's backend (reference unless MEGACPP_KERNELS says so); a prefill that
        continues a non-zero cache runs the reference, the only form that takes an initial
        state (an all-zero cache -- a first prefill chunk -- is the same as none; with
        ``continues`` the cache is taken as non-zero unchecked).
        """
        unused = cache is None or fresh or (not continues and cache.is_zero())
        initial = None if unused else cache
        scan = mamba3_scan_chunked if initial is not None else resolve("mamba3_scan", v).fn
        return scan, initial

    def _recurrent_scan(
        self, **inputs: Tensor | Mamba3ScanState | None
    ) -> tuple[Tensor, Mamba3ScanState | None]:
        """The one-token scan :meth:`step` runs."""
        return mamba3_scan_recurrent(**inputs)

    def step(self, x: Tensor, cache: Mamba3ScanState) -> Tensor:
        """One recurrent decode step: x [B, 1, d_model] -> [B, 1, d_model]; updates cache.

        Without autograd, where the catalog chooses a ``mamba3_step`` backend other than the
        reference (the fused kernel on CUDA), that backend advances the B rows of ``cache`` in
        place: the speculative verify steps its k + 1 positions this way."""
        if x.ndim != 3 or x.shape[1] != 1:
            raise ValueError(f"step takes x of shape [B, 1, d_model], got {tuple(x.shape)}")
        fused = None if torch.is_grad_enabled() else self._chosen_step(x)
        if fused is not None:
            return self._fused_step(fused, x, cache, torch.arange(x.shape[0], device=x.device))
        y, final = self._recurrent_scan(**self._scan_inputs(x), initial_state=cache)
        cache.update_(final)
        return self._output(y)

    def _fused_step(self, step: Callable[..., Tensor], x: Tensor, pool: Mamba3ScanState,
                    slots: Tensor) -> Tensor:
        """x [B, 1, d_model] -> [B, 1, d_model] through ``step`` (a ``mamba3_step`` backend),
        advancing pool rows ``slots``."""
        proj = linear_rows(self.in_proj, x[:, 0], 0)  # [B, sum(_split)]
        y = step(proj, *pool.tensors(), slots, self.dt_bias, self.B_norm.weight,
                 self.C_norm.weight, self.B_bias, self.C_bias, self.D, self.norm_weight,
                 ngroups=self.ngroups, A_floor=self.A_floor, eps=self.norm_eps)  # [B, H*P]
        return self.out_proj(y[:, None])

    def _output(self, y: Tensor) -> Tensor:
        """out_proj of the gated scan output y [B, L, H, P], with ``outproj_norm`` first
        RMS-normed per head and scaled by ``norm_weight`` (float32 math)."""
        if self.outproj_norm:
            f32 = torch.promote_types(y.dtype, torch.float32)
            weight = self.norm_weight.to(f32).view(self.nheads, self.headdim)
            y = (F.rms_norm(y.to(f32), (self.headdim,), eps=self.norm_eps) * weight).to(y.dtype)
        return self.out_proj(y.flatten(2))  # [B, L, H, P] -> [B, L, d_model]

    def _scan_inputs(self, x: Tensor, again: tuple[Tensor, ...] = ()) -> dict[str, Tensor]:
        """Project x [B, L, d_model] (and its copies ``again``) into the scan's keyword
        arguments."""
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"expected x of shape [B, L, {self.d_model}], got {tuple(x.shape)}")
        H, P = self.nheads, self.headdim
        z, xs, b, c, dd_dt, dd_a, trap, angles = self._project(x, *again)
        adt, dt = _Gates.apply(dd_dt, dd_a, self.dt_bias, self.A_floor)  # [B, L, H] each
        return {
            "q": self.C_norm(c.unflatten(-1, self._bc_shape())),  # [B, L, G, N] (MIMO: R, G, N)
            "k": self.B_norm(b.unflatten(-1, self._bc_shape())),
            "v": xs.unflatten(-1, (H, P)),  # [B, L, H, P]
            "adt": adt,
            "dt": dt,
            "trap": trap,
            "q_bias": self.C_bias,
            "k_bias": self.B_bias,
            "angles": angles[:, :, None, :].expand(-1, -1, H, -1),  # [B, L, H, R], shared by heads
            "D": self.D,
            "z": z.unflatten(-1, (H, P)),
        }

    def _bc_shape(self) -> tuple[int, ...]:
        """Shape of one token's B (and C) vectors in the scan's q / k: (G, N)."""
        return (self.ngroups, self.d_state)

    def _project(self, x: Tensor, x2: Tensor | None = None, x3: Tensor | None = None
                 ) -> tuple[Tensor, ...]:
        """in_proj(x) as ``[z, x, B, C, dd_dt, dd_A, trap, angles]``: three GEMMs over row
        slices of its weight (z from x, x from x2, the rest from x3; x2, x3: copies of x,
        default x). The input's gradient is then three [T, d_model] products summed (by the
        pre-norm's backward kernel when they are its copies); one GEMM split eight ways needs
        the eight gradients concatenated into a [T, 3288] tensor first, which Inductor does in
        one masked kernel: 1.90 -> 1.86 ms per compiled mixer fwd+bwd at the nam56r-350m shape
        on an H100."""
        x2 = x if x2 is None else x2
        x3 = x if x3 is None else x3
        d = self.d_inner
        # each GEMM a row slice of in_proj (linear_rows: F.linear on the slice, or the slice's
        # float8 GEMM when FP8 training swapped in_proj for torchao's Float8Linear)
        rest = linear_rows(self.in_proj, x3, 2 * d).split(self._split[2:], dim=-1)
        return (linear_rows(self.in_proj, x, 0, d), linear_rows(self.in_proj, x2, d, 2 * d),
                *rest)

    def init_cache(
        self, batch_size: int, device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> Mamba3ScanState:
        """A zero cache (the state of an empty prefix) for ``batch_size`` sequences."""
        if dtype not in _CACHE_DTYPES:
            raise ConfigError(f"Mamba3 cache dtype must be one of {_CACHE_DTYPES}, got {dtype}")
        return self._zero_cache(batch_size, device, dtype)

    def _zero_cache(
        self, batch_size: int, device: torch.device | str | None, dtype: torch.dtype
    ) -> Mamba3ScanState:
        """The zero state of this mixer's scan (fields shaped as :class:`Mamba3ScanState`)."""
        return zero_scan_state(
            batch_size, self.nheads, self.headdim, self.d_state, self.n_angles,
            device=device, dtype=dtype,
        )

    def state_bytes(self, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of the decode cache: B * H * (R + P*N + N + P) elements of ``dtype`` (the
        cache's own size, from a cache on the meta device)."""
        return self._zero_cache(batch, "meta", dtype).nbytes()

    def residual_projections(self) -> list[Tensor]:
        return [self.out_proj.weight]

    def row_sliced_linears(self) -> tuple[str, ...]:
        """in_proj: :meth:`_project` multiplies three row slices of its weight."""
        return ("in_proj",)

    def flops_per_token(self, seq_len: int) -> int:
        """Forward matmul FLOPs per token: projections + chunked scan (FlopCounterMode's count)."""
        projections = 2 * self.d_model * (sum(self._split) + self.d_inner)
        H, P, N = self.nheads, self.headdim, self.d_state
        return projections + scan_flops_per_token(seq_len, self.chunk_size, H, P, N)


def hold_state_after(inputs: dict[str, Tensor], last_index: Tensor) -> dict[str, Tensor]:
    """The scan inputs with every token after its row's ``last_index`` [B] (right padding)
    turned into one that leaves the state as the last real token left it: step size and decay
    0 (no input, no decay, no rotation: every trapezoid weight of the padding is a multiple of
    dt), trapezoid and angle logits 0, and the last real token's k and v (the state keeps them
    as the trapezoid's previous pair). Selected, not multiplied, so even non-finite padding
    values stay out of the state and the real tokens' outputs (q and z of a padding token
    reach only its own output)."""
    v = inputs["v"]
    B, L = v.shape[:2]
    rows = torch.arange(B, device=v.device)
    padding = torch.arange(L, device=v.device)[None, :] > last_index[:, None]  # [B, L]
    held = dict(inputs)
    for name in ("dt", "adt", "trap", "angles"):  # [B, L, H] (angles [B, L, H, R])
        t = inputs[name]
        held[name] = t.masked_fill(padding.view(B, L, *([1] * (t.ndim - 2))), 0.0)
    for name in ("k", "v"):  # [B, L, ...]: the last real token's, repeated
        t = inputs[name]
        mask = padding.view(B, L, *([1] * (t.ndim - 2)))
        held[name] = torch.where(mask, t[rows, last_index][:, None], t)
    return held


def _doc_starts(doc_ids: Tensor, batch_seqlen: torch.Size) -> Tensor:
    """[B, L] document ids -> [B, L] bool, True where a new document starts (never at t = 0)."""
    if tuple(doc_ids.shape) != tuple(batch_seqlen) or doc_ids.is_floating_point():
        raise ValueError(
            f"doc_ids must be an integer tensor of shape {tuple(batch_seqlen)}, got "
            f"{doc_ids.dtype} {tuple(doc_ids.shape)}"
        )
    changed = doc_ids[:, 1:] != doc_ids[:, :-1]
    return torch.cat([torch.zeros_like(changed[:, :1]), changed], dim=1)


def _at_least_fp32(t: Tensor) -> Tensor:
    return t if t.dtype == torch.float64 else t.float()


def _softplus_grad(x: Tensor) -> Tensor:
    """d softplus(x) / dx as torch computes it: sigmoid(x), exactly 1 past the linear threshold
    (F.softplus's default 20)."""
    return torch.where(x > 20.0, 1.0, torch.sigmoid(x))


class _Gates(torch.autograd.Function):
    """(a * dt, dt) from in_proj's dd_dt and dd_A columns, in at least float32:

        dt = softplus(dd_dt + dt_bias),   a = -max(softplus(dd_A), A_floor)

    The same values and gradients as writing it out for autograd, but the backward is products
    with factors the forward saves (sigmoids, the clamp's mask), not softplus backwards. Under
    torch.compile these gradients are inputs of the cat that assembles in_proj's output
    gradient, which Inductor lowers as one kernel evaluating every input's math for every
    element: with exp / log1p / division in two of the inputs that kernel took 213 us per
    layer on an H100, ~3x its bytes. Saved: four [B, L, H] float32 tensors."""

    @staticmethod
    def forward(ctx, dd_dt: Tensor, dd_a: Tensor, dt_bias: Tensor, a_floor: float):
        u = _at_least_fp32(dd_dt) + dt_bias
        w = _at_least_fp32(dd_a)
        dt, softplus_w = F.softplus(u), F.softplus(w)
        a = -softplus_w.clamp(min=a_floor)
        # d dt / du = softplus'(u); d a / dw = -softplus'(w) where softplus(w) >= A_floor (the
        # clamp's backward passes the gradient at the bound), else 0
        da_dw = torch.where(softplus_w >= a_floor, -_softplus_grad(w), 0.0)
        ctx.save_for_backward(dt, a, _softplus_grad(u), da_dw)
        ctx.dtypes = (dd_dt.dtype, dd_a.dtype, dt_bias.dtype)
        return a * dt, dt

    @staticmethod
    def backward(ctx, d_adt: Tensor, d_dt: Tensor):
        dt, a, ddt_du, da_dw = ctx.saved_tensors
        du = (d_dt + d_adt * a) * ddt_du
        dw = d_adt * dt * da_dw
        d_bias = du.reshape(-1, du.shape[-1]).sum(0)
        dt_dtype, a_dtype, bias_dtype = ctx.dtypes
        return du.to(dt_dtype), dw.to(a_dtype), d_bias.to(bias_dtype), None
