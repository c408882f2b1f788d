"""A:mla -- multi-head latent attention (DeepSeek-V2/V3).

Per token (H heads; dn = qk_nope_head_dim, dr = qk_rope_head_dim, dv = v_head_dim,
r = kv_lora_rank)::

    q_in          = rms_norm(q_down(x))          # [q_lora_rank]; x itself when q_lora_rank = 0
    q_nope, q_pe  = q_up(q_in)                   # [H, dn], [H, dr]; q_pe gets RoPE
    latent, k_pe  = kv_down(x)                   # [r], [dr]: joint KV compression + one RoPE
    latent        = rms_norm(latent)             #   key shared by every head (MQA-style)
    k_nope, v     = kv_up(latent)                # [H, dn], [H, dv]   (W_UK | W_UV)
    o_h           = softmax(scale * (q_nope_h . k_nope_h + q_pe_h . k_pe)) v_h
    y             = out_proj(o)                  # scale = (dn + dr) ** -0.5

Training and the full forward run this *naive* form through SDPA. The (paged) cache holds
only ``latent`` and ``k_pe`` -- ``(r + dr)`` numbers per token instead of GQA's
``2 * n_kv_heads * head_dim`` -- and decoding can run either form:

* ``naive``: up-project every cached latent to per-head K/V each step, then attend.
* ``absorbed`` (default): fold W_UK into the query (``q_lat_h = W_UK_h^T q_nope_h``, so
  ``q_nope_h . k_nope_h = q_lat_h . latent``) and W_UV into the output (attend over the
  latents, then ``o_h = W_UV_h o_lat_h``): no per-head K/V is ever materialised.

Both are the same function of the weights; the tests check absorbed == naive == full
forward in float64. RoPE is the half-split convention used everywhere in this package
(DeepSeek's released code interleaves pairs; the two differ by a fixed permutation of the
rotary dims, which only matters when importing their weights).

This is a mixer only: no outer pre-norm and no residual (the block wrapper adds those).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megacpp.kernels.ops.document_attention.reference import document_causal_mask
from megacpp.kernels.ops.sparse_attention import latent_attention
from megacpp.model.cache import PagedView
from megacpp.model.config import ModelConfig
from megacpp.model.mixer import Mixer
from megacpp.model.norm import RMSNorm
from megacpp.model.rope import apply_rope, rope_range

DECODE_MODES = ("absorbed", "naive")


class MultiHeadLatentAttention(Mixer):
    """Multi-head latent attention: ``[B, L, d_model] -> [B, L, d_model]``.

    Parameters (DeepSeek's names in brackets): ``q_down`` [wq_a] and ``q_norm`` [q_norm]
    (only when ``q_lora_rank > 0``), ``q_up`` [wq_b, or wq], ``kv_down``
    [wkv_a / kv_a_proj_with_mqa], ``kv_norm`` [kv_norm / kv_a_layernorm], ``kv_up``
    [wkv_b / kv_b_proj; rows per head: dn key rows then dv value rows] and ``out_proj`` [wo].
    ``decode_mode`` ("absorbed" or "naive") picks the cached-decode form.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        q_lora_rank: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        rope_base: float = 10000.0,
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.n_heads, self.kv_lora_rank = n_heads, kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.rope_base = rope_base
        self.scale = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5
        self.decode_mode = "absorbed"
        self.q_down = nn.Linear(d_model, q_lora_rank, bias=False) if q_lora_rank else None
        self.q_norm = RMSNorm(q_lora_rank, norm_eps) if q_lora_rank else None
        self.q_in_dim = q_lora_rank or d_model
        qk_dim = qk_nope_head_dim + qk_rope_head_dim
        self.q_up = nn.Linear(self.q_in_dim, n_heads * qk_dim, bias=False)
        self.kv_down = nn.Linear(d_model, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(kv_lora_rank, norm_eps)
        self.kv_up = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.out_proj = nn.Linear(n_heads * v_head_dim, d_model, bias=False)

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> MultiHeadLatentAttention:
        m = cfg.mla
        return cls(
            d_model=cfg.d_model,
            n_heads=m.n_heads,
            q_lora_rank=m.q_lora_rank,
            kv_lora_rank=m.kv_lora_rank,
            qk_nope_head_dim=m.qk_nope_head_dim,
            qk_rope_head_dim=m.qk_rope_head_dim,
            v_head_dim=m.v_head_dim,
            rope_base=m.rope_base,
            norm_eps=cfg.norm_eps,
        )

    # -- projections (shared with DSA) --------------------------------------------------------
    def rope_tables(self, offset: int, length: int, x: Tensor) -> tuple[Tensor, Tensor]:
        """cos/sin [L, rope_dim/2] at positions ``offset .. offset + length - 1``, shared by
        the batch rows (float64 for float64 models; constants of a compiled graph:
        :func:`rope_range`)."""
        table_dtype = torch.promote_types(x.dtype, torch.float32)
        return rope_range(offset, length, self.rope_dim, self.rope_base, table_dtype, x.device)

    def paged_rope_tables(self, cache: PagedView, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos/sin [B, L, rope_dim/2] at a paged batch's per-row positions (shared by layers)."""
        table_dtype = torch.promote_types(dtype, torch.float32)
        return cache.batch.rope(self.rope_dim, self.rope_base, table_dtype)

    def query_input(self, x: Tensor) -> Tensor:
        """The compressed, normalised query ``q_in`` [B, L, q_lora_rank] (or x when full rank)."""
        return x if self.q_down is None else self.q_norm(self.q_down(x))

    def queries(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, L, D] -> q_nope [B, L, H, dn], q_rope [B, L, H, dr] (rotated), q_in."""
        B, L, _ = x.shape
        q_in = self.query_input(x)
        q = self.q_up(q_in).view(B, L, self.n_heads, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        # cos/sin [L, dr/2] (or [B, L, dr/2] for per-row positions) -> broadcast over heads
        return q_nope, apply_rope(q_rope, cos.unsqueeze(-2), sin.unsqueeze(-2)), q_in

    def compress_kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x [B, L, D] -> latent [B, L, r] (normalised), k_rope [B, L, dr] (rotated)."""
        latent, k_rope = self.kv_down(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        return self.kv_norm(latent), apply_rope(k_rope, cos, sin)

    def up_weights(self) -> tuple[Tensor, Tensor]:
        """W_UK [H, dn, r] and W_UV [H, dv, r]: the per-head blocks of ``kv_up``."""
        w = self.kv_up.weight.view(self.n_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def absorb_query(self, q_nope: Tensor) -> Tensor:
        """q_nope [B, L, H, dn] -> q_latent [B, L, H, r] with W_UK folded in."""
        w_uk, _ = self.up_weights()
        return torch.einsum("blhn,hnr->blhr", q_nope, w_uk)

    def output_from_latent(self, o_latent: Tensor) -> Tensor:
        """Attention output over latents [B, L, H, r] -> W_UV per head -> out_proj -> [B, L, D]."""
        _, w_uv = self.up_weights()
        o = torch.einsum("blhr,hvr->blhv", o_latent, w_uv)
        return self.out_proj(o.flatten(2))

    # -- attention ------------------------------------------------------------------------------
    def forward(
        self, x: Tensor, doc_ids: Tensor | None = None, again: tuple[Tensor, ...] = ()
    ) -> Tensor:
        """x [B, L, D] -> [B, L, D] in the naive form (training, full forward)."""
        cos, sin = self.rope_tables(0, x.shape[1], x)
        q_nope, q_rope, _ = self.queries(x, cos, sin)
        latent, k_rope = self.compress_kv(x, cos, sin)
        mask = None if doc_ids is None else document_causal_mask(doc_ids)[:, None]
        return self.attend_naive(q_nope, q_rope, latent, k_rope, mask)

    def forward_paged(
        self, x: Tensor, cache: PagedView, again: tuple[Tensor, ...] = ()
    ) -> Tensor:
        """Rows at their own positions over the paged latent cache (``decode_mode`` form)."""
        cos, sin = self.paged_rope_tables(cache, x.dtype)  # [B, L, dr/2]
        q_nope, q_rope, _ = self.queries(x, cos, sin)
        latent, k_rope = self.compress_kv(x, cos, sin)
        latent, k_rope = cache.append(latent=latent, k_rope=k_rope)  # [B, T, r], [B, T, dr]
        allowed = cache.batch.allowed_keys(latent.shape[1])  # [B, L, T]
        if self.decode_mode == "absorbed":
            return self.attend_absorbed(q_nope, q_rope, latent, k_rope, allowed)
        return self.attend_naive(q_nope, q_rope, latent, k_rope, allowed[:, None])

    def attend_naive(
        self, q_nope: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor, mask: Tensor | None
    ) -> Tensor:
        """Up-project latents [B, T, r] to per-head K/V and attend through SDPA.

        ``mask``: broadcastable to [B, H, L, T] bool, or None for plain causal (L == T)."""
        B, L, H, _ = q_nope.shape
        T = latent.shape[1]
        k_nope, v = self.kv_up(latent).view(B, T, H, -1).split([self.nope_dim, self.v_dim], -1)
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(1, 2)  # [B, H, L, dn + dr]
        k_shared = k_rope[:, :, None].expand(B, T, H, self.rope_dim)
        k = torch.cat([k_nope, k_shared], dim=-1).transpose(1, 2)  # [B, H, T, dn + dr]
        out = F.scaled_dot_product_attention(
            q, k, v.transpose(1, 2), attn_mask=mask, is_causal=mask is None, scale=self.scale
        )  # [B, H, L, dv]
        return self.out_proj(out.transpose(1, 2).reshape(B, L, H * self.v_dim))

    def attend_absorbed(
        self, q_nope: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor, allowed: Tensor
    ) -> Tensor:
        """Attend directly over the cached latents [B, T, r]; ``allowed`` [B|1, L, T]."""
        o_latent, _ = latent_attention(
            self.absorb_query(q_nope), q_rope, latent[:, None], k_rope[:, None], allowed, self.scale
        )
        return self.output_from_latent(o_latent)

    # -- decoding and accounting -------------------------------------------------------------
    def paged_layout(self) -> dict[str, tuple[int, ...]]:
        """Per-token cache entries of the paged layout: the normalised latent and the
        rotated shared RoPE key."""
        return {"latent": (self.kv_lora_rank,), "k_rope": (self.rope_dim,)}

    def cache_bytes_per_token(self, dtype: torch.dtype = torch.bfloat16) -> int:
        return (self.kv_lora_rank + self.rope_dim) * dtype.itemsize

    def residual_projections(self) -> list[Tensor]:
        return [self.out_proj.weight]

    def projection_flops_per_token(self) -> int:
        """Forward FLOPs of the query path, the KV down-projection and out_proj."""
        d_model = self.kv_down.in_features
        q_path = 2 * self.q_in_dim * self.q_up.out_features
        if self.q_down is not None:
            q_path += 2 * d_model * self.q_in_dim
        return (
            q_path
            + 2 * d_model * self.kv_down.out_features
            + 2 * self.out_proj.in_features * (self.out_proj.out_features)
        )

    def flops_per_token(self, seq_len: int) -> int:
        """Forward matmul FLOPs per token of the naive (training) form over ``seq_len`` keys,
        counted over the full L x L score matrix as for GQA."""
        H, qk_dim = self.n_heads, self.nope_dim + self.rope_dim
        kv_up = 2 * self.kv_lora_rank * self.kv_up.out_features
        attention = 2 * seq_len * H * qk_dim + 2 * seq_len * H * self.v_dim
        return self.projection_flops_per_token() + kv_up + attention
