"""The ``R`` mixer: Gated DeltaNet (Yang, Kautz & Hatamizadeh, ICLR 2025), a matrix-state
recurrent mixer updated with the gated delta rule.

Per token (see ``megacpp.kernels.ops.gated_delta`` for the rule itself)::

    q, k, v, gate, a, b = in_proj(x)
    q, k, v  = silu(short causal depthwise conv(q | k | v))   # never reads across documents
    q, k     = l2norm(q), l2norm(k)                            # per head
    g        = -exp(A_log) * softplus(a + dt_bias)             # log decay <= 0, per head
    beta     = sigmoid(b)                                      # write strength, per head
    o        = gated_delta_rule(q, k, v, g, beta)              # q scaled by head_k_dim ** -0.5
    y        = o_proj(rms_norm(o) * silu(gate))                # per-head RMSNorm, output gate

This is a mixer only: no outer pre-norm and no residual (the block wrapper adds those).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor, nn

from megacpp.errors import ConfigError
from megacpp.kernels.ops.gated_delta import (
    flops_per_token as gated_delta_flops_per_token,
)
from megacpp.kernels.ops.gated_delta import gated_delta_rule_recurrent
from megacpp.kernels.ops.gated_delta_step.reference import (
    decay_and_write_strength,
    gated_rms_output,
    l2norm,
)
from megacpp.kernels.ops.short_conv.reference import short_causal_conv
from megacpp.kernels.runtime import resolve
from megacpp.model.mixer import RecurrentMixer

if TYPE_CHECKING:
    from megacpp.model.config import ModelConfig

A_INIT_RANGE = (1.0, 16.0)  # exp(A_log) ~ U(1, 16), as in fla's GatedDeltaNet
DT_INIT_RANGE = (1e-3, 1e-1)  # softplus(dt_bias) log-uniform in this range (Mamba-2 style)
DT_INIT_FLOOR = 1e-4

GatedDeltaOp = Callable[..., tuple[Tensor, Tensor | None]]


@dataclass
class GatedDeltaCache:
    """Decode-time state of one :class:`GatedDeltaNetMixer`; updated in place.

    ``state``      [B, H, head_k_dim, head_v_dim]  the matrix memory, fla's orientation
                   (``o = state^T q``); keep it float32.
    ``conv_state`` [B, C, conv_size - 1]  the last conv_size - 1 conv inputs (q | k | v
                   channels, C = 2*H*head_k_dim + H*head_v_dim), oldest first; zero where the
                   current document has no earlier token.
    """

    state: Tensor
    conv_state: Tensor

    def nbytes(self) -> int:
        """Bytes held by the cache tensors."""
        return sum(t.numel() * t.element_size() for t in (self.state, self.conv_state))


class GatedDeltaNetMixer(RecurrentMixer):
    """Gated DeltaNet sequence mixer: ``[B, L, d_model] -> [B, L, d_model]``.

    Args:
        d_model: model width.
        n_heads: number of heads (q, k and v share them).
        head_k_dim: per-head query/key width K (the state is K x V per head).
        head_v_dim: per-head value width V.
        conv_size: kernel width of the short causal depthwise conv on q, k, v.
        chunk_size: chunk length of the chunked op used by :meth:`forward`.
        norm_eps: epsilon of the per-head output RMSNorm.
        init_std: std of the normal init of ``in_proj`` and ``o_proj``.

    Parameters: ``in_proj`` (the row blocks are fla's q_proj | k_proj | v_proj | g_proj |
    a_proj | b_proj), ``conv_weight`` [C, conv_size] (fla's q/k/v_conv1d weights
    concatenated), ``A_log`` and ``dt_bias`` [H] (marked ``_no_weight_decay``), ``norm_weight``
    [head_v_dim] (shared by the heads, as fla's o_norm) and ``o_proj``.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_size: int = 4,
        chunk_size: int = 64,
        norm_eps: float = 1e-5,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        sizes = {
            "d_model": d_model,
            "n_heads": n_heads,
            "head_k_dim": head_k_dim,
            "head_v_dim": head_v_dim,
            "conv_size": conv_size,
            "chunk_size": chunk_size,
        }
        for name, value in sizes.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(
                    f"GatedDeltaNetMixer {name} must be a positive integer, got {value!r}"
                )
        for name, value in {"norm_eps": norm_eps, "init_std": init_std}.items():
            if not value > 0:
                raise ConfigError(f"GatedDeltaNetMixer {name} must be > 0, got {value!r}")

        self.d_model, self.n_heads = d_model, n_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.conv_size, self.chunk_size = conv_size, chunk_size
        self.norm_eps, self.init_std = norm_eps, init_std
        self.key_dim = n_heads * head_k_dim
        self.value_dim = n_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim  # q | k | v channels

        self.in_proj = nn.Linear(d_model, self.conv_dim + self.value_dim + 2 * n_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, conv_size))
        self.A_log = nn.Parameter(torch.empty(n_heads))
        self.dt_bias = nn.Parameter(torch.empty(n_heads))
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        self.norm_weight = nn.Parameter(torch.empty(head_v_dim))
        self.o_proj = nn.Linear(self.value_dim, d_model, bias=False)
        self.reset_parameters()

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> GatedDeltaNetMixer:
        r = cfg.rnn
        return cls(
            d_model=cfg.d_model,
            n_heads=r.n_heads,
            head_k_dim=r.head_k_dim,
            head_v_dim=r.head_v_dim,
            conv_size=r.conv_size,
            chunk_size=r.chunk_size,
            norm_eps=cfg.norm_eps,
            init_std=cfg.init_std,
        )

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise every parameter (fla / Mamba-2 conventions for the decay)."""
        nn.init.normal_(self.in_proj.weight, std=self.init_std)
        nn.init.normal_(self.o_proj.weight, std=self.init_std)
        bound = 1.0 / math.sqrt(self.conv_size)  # nn.Conv1d's default for a depthwise conv
        nn.init.uniform_(self.conv_weight, -bound, bound)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(*A_INIT_RANGE).log())
        log_lo, log_hi = (math.log(x) for x in DT_INIT_RANGE)
        dt = torch.exp(torch.empty_like(self.dt_bias).uniform_(log_lo, log_hi))
        dt = dt.clamp(min=DT_INIT_FLOOR)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        nn.init.ones_(self.norm_weight)

    def forward(
        self, x: Tensor, doc_ids: Tensor | None = None, again: tuple[Tensor, ...] = (),
        cache: GatedDeltaCache | None = None, fresh: bool = False,
        last_index: Tensor | None = None, continues: bool = False,
    ) -> Tensor:
        """Mix a sequence with the chunked op (``again`` is empty: ``INPUT_FANOUT`` 1).

        ``x`` [B, L, d_model]. ``doc_ids`` [B, L] integer document index per token of a packed
        row: any change from t-1 to t starts a new document at t, which sees neither the
        recurrent state nor the conv inputs of earlier documents. Without ``cache`` this is the
        training path (zero initial state). With ``cache`` it continues from the cache (its
        first token continues the cached document) and writes the final state back: prefill.
        ``fresh``: start from the empty state whatever ``cache`` holds (only written).
        ``last_index`` [B]: each row's last real token; the tokens after it (right padding)
        neither decay nor write the state (g = 0, beta = 0) and the conv tail written back
        ends at the last real token. ``continues`` changes nothing here (the cache is read
        without a check either way).
        """
        chunked = resolve("gated_delta", x).fn  # the reference unless MEGACPP_KERNELS picks one
        op = partial(chunked, chunk_size=self.chunk_size)
        return self._mix(x, doc_ids, cache, op, fresh, last_index)

    #: The catalog surface of the fused paged decode step.
    STEP_SURFACE: ClassVar[str] = "gated_delta_step"

    def step(self, x: Tensor, cache: GatedDeltaCache) -> Tensor:
        """One decode step with the recurrent op: ``x`` [B, 1, d_model]; updates ``cache``.

        Without autograd, where the catalog chooses a ``gated_delta_step`` backend other than
        the reference (the fused kernel on CUDA), that backend advances the B rows of
        ``cache`` in place: the speculative verify steps its k + 1 positions this way."""
        if x.dim() != 3 or x.shape[1] != 1:
            raise ValueError(f"step takes x of shape [B, 1, d_model], got {list(x.shape)}")
        fused = None if torch.is_grad_enabled() else self._chosen_step(x)
        if fused is not None:
            self._check_inputs(x, None, cache)
            return self._fused_step(fused, x, cache, torch.arange(x.shape[0], device=x.device))
        return self._mix(x, None, cache, gated_delta_rule_recurrent)

    def _fused_step(self, step: Callable[..., Tensor], x: Tensor, pool: GatedDeltaCache,
                    slots: Tensor) -> Tensor:
        """x [B, 1, d_model] -> [B, 1, d_model] through ``step`` (a ``gated_delta_step``
        backend), advancing pool rows ``slots``."""
        proj = self.in_proj(x[:, 0])  # [B, conv_dim + value_dim + 2H]
        y = step(proj, pool.state, pool.conv_state, slots, self.conv_weight, self.A_log,
                 self.dt_bias, self.norm_weight, eps=self.norm_eps)  # [B, H*V]
        return self.o_proj(y[:, None])

    def init_cache(
        self, batch_size: int, device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> GatedDeltaCache:
        """An all-zero cache for ``batch_size`` sequences (nothing seen yet)."""
        shapes = self._cache_shapes(batch_size)
        return GatedDeltaCache(
            **{
                name: torch.zeros(shape, device=device, dtype=dtype)
                for name, shape in shapes.items()
            }
        )

    def state_bytes(self, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of the decode cache for ``batch`` sequences (= ``init_cache(...).nbytes()``)."""
        numel = sum(math.prod(shape) for shape in self._cache_shapes(batch).values())
        return numel * torch.empty((), dtype=dtype).element_size()

    def residual_projections(self) -> list[Tensor]:
        """None: ``o_proj`` keeps the plain ``init_std`` normal init, not the scaled one."""
        return []

    def _cache_shapes(self, batch: int) -> dict[str, tuple[int, ...]]:
        """The layout of :class:`GatedDeltaCache` for ``batch`` sequences."""
        return {
            "state": (batch, self.n_heads, self.head_k_dim, self.head_v_dim),
            "conv_state": (batch, self.conv_dim, self.conv_size - 1),
        }

    def flops_per_token(self, seq_len: int) -> int:
        """Forward FLOPs per token of :meth:`forward` on ``seq_len`` tokens: projections,
        short conv and the chunked op (2*m*n*k per matmul, as FlopCounterMode counts).
        Elementwise work (norms, gates, activations) and the op's triangular solves are not
        counted; see ``megacpp.kernels.ops.gated_delta.flops_per_token``."""
        projections = 2 * self.d_model * (self.in_proj.out_features + self.value_dim)
        conv = 2 * self.conv_dim * self.conv_size
        op = gated_delta_flops_per_token(
            seq_len, self.n_heads, self.head_k_dim, self.head_v_dim, self.chunk_size
        )
        return projections + conv + op

    def _mix(
        self, x: Tensor, doc_ids: Tensor | None, cache: GatedDeltaCache | None, op: GatedDeltaOp,
        fresh: bool = False, last_index: Tensor | None = None,
    ) -> Tensor:
        self._check_inputs(x, doc_ids, cache)
        B, L, _ = x.shape
        H, K, V = self.n_heads, self.head_k_dim, self.head_v_dim
        qkv, gate, a, b = self.in_proj(x).split([self.conv_dim, self.value_dim, H, H], dim=-1)
        conv_tail = None
        if cache is None:  # the catalog's backend (reference unless MEGACPP_KERNELS says so)
            qkv = resolve("short_conv", qkv).fn(qkv, self.conv_weight, doc_ids)
        else:
            history = None if fresh else cache.conv_state  # None: zeros
            conv_in = qkv
            qkv, conv_tail = short_causal_conv(qkv, self.conv_weight, history, doc_ids)
            if last_index is not None:
                conv_tail = _conv_tail_at(history, conv_in, last_index)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2norm(q.view(B, L, H, K))  # [B, L, H, K]
        k = l2norm(k.view(B, L, H, K))
        v = v.view(B, L, H, V)
        g, beta = decay_and_write_strength(a, b, self.A_log, self.dt_bias)  # [B, L, H] each
        if last_index is not None:  # right padding: no decay, no write (selected, so even
            #                           non-finite padding values stay out of the state)
            padding = torch.arange(L, device=x.device)[None, :, None] > last_index[:, None, None]
            g, beta = g.masked_fill(padding, 0.0), beta.masked_fill(padding, 0.0)
            q, k, v = (t.masked_fill(padding[..., None], 0.0) for t in (q, k, v))

        o, state = op(
            q,
            k,
            v,
            g,
            beta,
            initial_state=None if cache is None or fresh else cache.state,
            reset=None if doc_ids is None else document_starts(doc_ids),
            output_final_state=cache is not None,
        )  # o: [B, L, H, V]
        if cache is not None:
            cache.state.copy_(state.detach())
            cache.conv_state.copy_(conv_tail.detach())

        o = gated_rms_output(o, gate, self.norm_weight, self.norm_eps, x.dtype)  # [B, L, H*V]
        return self.o_proj(o)  # [B, L, d_model]

    def _check_inputs(
        self, x: Tensor, doc_ids: Tensor | None, cache: GatedDeltaCache | None
    ) -> None:
        if x.dim() != 3 or x.shape[1] < 1 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be [B, L >= 1, {self.d_model}], got {list(x.shape)}")
        B, L, _ = x.shape
        if doc_ids is not None and (tuple(doc_ids.shape) != (B, L) or doc_ids.is_floating_point()):
            raise ValueError(
                f"doc_ids must be an integer tensor of shape [{B}, {L}], got "
                f"{doc_ids.dtype} {list(doc_ids.shape)}"
            )
        if cache is not None:
            for name, shape in self._cache_shapes(B).items():
                got = tuple(getattr(cache, name).shape)
                if got != shape:
                    raise ValueError(
                        f"cache.{name} must have shape {list(shape)} for batch {B}, got {list(got)}"
                    )


def _conv_tail_at(history: Tensor | None, conv_in: Tensor, last_index: Tensor) -> Tensor:
    """The conv inputs ending at each row's ``last_index`` [B]: [B, C, W - 1], oldest first,
    from ``history`` [B, C, W - 1] (None: zeros) followed by ``conv_in`` [B, L, C]."""
    B, _, C = conv_in.shape
    if history is None:
        raise ValueError("right padding (last_index) needs the conv history to continue")
    width = history.shape[2]
    seq = torch.cat([history.transpose(1, 2).to(conv_in.dtype), conv_in], dim=1)  # [B, W-1+L, C]
    # token t sits at W - 1 + t: the W - 1 inputs ending at it start at index t + 1
    index = last_index[:, None] + torch.arange(1, width + 1, device=conv_in.device)  # [B, W-1]
    return seq.gather(1, index[:, :, None].expand(B, width, C)).transpose(1, 2)


def document_starts(doc_ids: Tensor) -> Tensor:
    """[B, L] bool: True where a token's document differs from the previous token's."""
    starts = torch.zeros_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return starts
