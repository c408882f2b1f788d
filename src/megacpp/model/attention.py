"""A:gqa -- grouped-query attention with RoPE and optional QK-norm, through SDPA.

Packed rows: ``doc_ids`` [B, L] (per-token document index) restricts every query to keys of
its own document, so attention never crosses a document boundary: the catalog's
``document_attention`` surface (:mod:`megacpp.kernels.ops.document_attention.flex`), FlexAttention
over a block mask on CUDA, SDPA with the dense mask as the reference.

Paged decode (one token per row over the serving engine's K/V pool): the catalog's
``paged_attention_decode`` surface where it chooses a kernel (Triton on CUDA: K/V read in
place through the block table), else the gather + mask + :func:`grouped_attention` path.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megacpp.kernels.runtime import resolve
from megacpp.model.cache import PagedView
from megacpp.model.config import ModelConfig
from megacpp.model.mixer import Mixer
from megacpp.model.norm import RMSNorm
from megacpp.model.rope import apply_rope, rope_range


class GroupedQueryAttention(Mixer):
    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        rope_base: float = 10000.0,
        qk_norm: bool = True,
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.rope_base = rope_base
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.kv_proj = nn.Linear(d_model, 2 * n_kv_heads * head_dim, bias=False)
        self.out_proj = nn.Linear(n_heads * head_dim, d_model, bias=False)
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else nn.Identity()

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> GroupedQueryAttention:
        a = cfg.attention
        return cls(cfg.d_model, a.n_heads, a.n_kv_heads, a.head_dim, a.rope_base, a.qk_norm,
                   cfg.norm_eps)

    # the pre-norm block hands x in twice (Block, RMSNorm.with_skip's fanout, as for the MoE):
    # q_proj reads x, kv_proj ``again``, and the norm's backward kernel sums their two input
    # gradients (autograd's add of them was an Inductor kernel of its own: 0.32 ms of the
    # nam56r-350m step on an H100, 14 layers)
    INPUT_FANOUT = 2

    def forward(
        self, x: torch.Tensor, doc_ids: torch.Tensor | None = None,
        again: tuple[torch.Tensor, ...] = (),
    ) -> torch.Tensor:
        """x [B, L, D] -> [B, L, D]. ``again``: (the same values as x, as a tensor of its own)
        for kv_proj to read; default x."""
        B, L, _ = x.shape
        q, k, v = self._project(x, again)
        table_dtype = torch.promote_types(x.dtype, torch.float32)
        cos, sin = rope_range(0, L, self.head_dim, self.rope_base, table_dtype, x.device)
        if isinstance(self.q_norm, RMSNorm):  # QK-norm and RoPE in one op (one kernel each way
            # with the fused backend: no rotation kernels, no extra pass over q and k)
            q, k = self.q_norm(q, rope=(cos, sin)), self.k_norm(k, rope=(cos, sin))
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        if doc_ids is not None:  # packed rows: the catalog's document_attention surface
            out = resolve("document_attention", q).fn(q, k, v, doc_ids)  # [B, H, L, hd]
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.out_proj(out.transpose(1, 2).reshape(B, L, -1))  # out: [B, H, L, hd]

    def _project(
        self, x: torch.Tensor, again: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, L, D] -> q [B, H, L, hd], k, v [B, Hkv, L, hd] (before norm and RoPE)."""
        B, L, _ = x.shape
        q = self.q_proj(x).view(B, L, self.n_heads, self.head_dim).transpose(1, 2)
        kv = self.kv_proj(again[0] if again else x)
        k, v = kv.view(B, L, 2, self.n_kv_heads, self.head_dim).unbind(2)
        return q, k.transpose(1, 2), v.transpose(1, 2)

    def forward_paged(
        self, x: torch.Tensor, cache: PagedView, again: tuple[torch.Tensor, ...] = ()
    ) -> torch.Tensor:
        """Rows at their own positions over the paged cache: write the new keys/values, gather
        each row's blocks, attend with keys past the query's position masked.

        A decode step (one token per row, no document ids) whose catalog backend for
        ``paged_attention_decode`` is not the reference (the Triton kernel on CUDA) attends
        straight from the pool through the block table instead: no gather, no mask. Under
        torch.compile (``compile_decode``) the gather path runs, for inductor to fuse: a
        catalog backend is a graph break there."""
        q, k, v = self._project(x, again)
        q, k = self.q_norm(q), self.k_norm(k)
        B, _, L, _ = q.shape
        batch = cache.batch
        table_dtype = torch.promote_types(q.dtype, torch.float32)
        cos, sin = batch.rope(self.head_dim, self.rope_base, table_dtype)  # [B, L, hd/2]
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, L, hd/2]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if L == 1 and batch.doc_ids is None and not torch.compiler.is_compiling():
            backend = resolve("paged_attention_decode", q)
            if backend.role != "fallback":
                cache.pool.write(batch, k=k.transpose(1, 2), v=v.transpose(1, 2))
                pool = cache.pool.tensors
                out = backend.fn(q[:, :, 0], pool["k"], pool["v"], batch.block_tables,
                                 batch.positions[:, 0])  # [B, H, hd]
                return self.out_proj(out.reshape(B, 1, -1))
        keys, values = cache.append(k=k.transpose(1, 2), v=v.transpose(1, 2))  # [B, T, Hkv, hd]
        allowed = cache.batch.allowed_keys(keys.shape[1])  # [B, L, T]
        out = grouped_attention(q, keys, values, allowed)  # [B, H, L, hd]
        return self.out_proj(out.transpose(1, 2).reshape(B, L, -1))

    def paged_layout(self) -> dict[str, tuple[int, ...]]:
        """Per-token cache entries of the paged layout: keys and values (after RoPE)."""
        return {"k": (self.n_kv_heads, self.head_dim), "v": (self.n_kv_heads, self.head_dim)}

    def residual_projections(self) -> list[torch.Tensor]:
        return [self.out_proj.weight]

    def flops_per_token(self, seq_len: int) -> int:
        """Forward matmul FLOPs per token: projections plus QK^T and AV over ``seq_len`` keys.

        Counted over the full L x L score matrix, as SDPA's FLOP formula does (the causal
        mask halves the useful work; kernels may or may not skip the masked half).
        """
        d_model = self.q_proj.in_features
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        proj = 2 * d_model * (q_dim + 2 * kv_dim) + 2 * q_dim * d_model
        return proj + 2 * 2 * seq_len * q_dim

    def cache_bytes_per_token(self, dtype: torch.dtype = torch.bfloat16) -> int:
        return 2 * self.n_kv_heads * self.head_dim * dtype.itemsize


def grouped_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor
) -> torch.Tensor:
    """Grouped-query attention of per-row key sets without repeating K/V per head (the paged
    decode reference): q [B, H, L, hd]; keys, values [B, T, Hkv, hd]; allowed [B, L, T] bool
    (every query needs one allowed key) -> [B, H, L, hd]. Scores and softmax in at least
    float32; the H // Hkv query heads of a group share their K/V head."""
    B, H, L, hd = q.shape
    Hkv = keys.shape[2]
    qg = q.reshape(B, Hkv, H // Hkv * L, hd)  # heads of one group are adjacent
    dtype = torch.promote_types(q.dtype, torch.float32)
    scores = torch.einsum("bkqd,btkd->bkqt", qg, keys).to(dtype) * hd**-0.5  # [B, Hkv, G*L, T]
    scores = scores.view(B, Hkv, H // Hkv, L, -1).masked_fill(~allowed[:, None, None], -math.inf)
    probs = scores.softmax(-1).to(values.dtype).view(B, Hkv, H // Hkv * L, -1)
    out = torch.einsum("bkqt,btkd->bkqd", probs, values)  # [B, Hkv, G*L, hd]
    return out.reshape(B, H, L, hd)
