"""A:dsa -- DeepSeek sparse attention (DeepSeek-V3.2): MLA + a lightning indexer + top-k.

DSA here is :class:`~megacpp.model.mla.MultiHeadLatentAttention` run in its absorbed (MQA)
form -- every head attends to the same compressed latents, as in V3.2 -- with a lightning
indexer choosing which keys each query sees::

    q_idx, w  = indexer.q_proj(q_in), indexer.weights_proj(x) / sqrt(Hi)   # Hi small heads
    k_idx     = rope(rms_norm(indexer.k_proj(x)))                          # one key per token
    I[t, s]   = sum_h w[t, h] * relu(q_idx[t, h] . k_idx[s] / sqrt(di))
    S_t       = top_k allowed keys of I[t, :]    (allowed: causal, same document)
    y_t       = MLA attention of query t over the keys in S_t only

Training follows V3.2's two stages (``dsa.mode``):

* ``dense_warmup``: attention is dense (all allowed keys); the indexer learns
  ``KL(p_t || softmax(I_t))`` toward the head-summed dense attention distribution ``p_t``.
* ``sparse``: attention uses the top-k keys; the indexer keeps learning the same KL
  restricted to the selected keys.

In both, the indexer's inputs (``x`` and ``q_in``) and the KL target are detached: the KL
trains the indexer only, and the LM loss never reaches the indexer (the top-k selection is
not differentiable). The KL, times ``indexer_loss_coef``, is exposed as ``aux_loss`` (like
the MoE balance loss) in training mode. V3.2 also freezes the rest of the model during the
warm-up; that is the trainer's choice (see :func:`indexer_parameters`).

Queries are processed in chunks of ``query_chunk``, so no tensor is ever ``L x L``: the
largest live tensors are ``[B, C, max(H, Hi), T]`` scores and, in the sparse path on the
reference backend, the gathered ``[B, C, top_k, r + dr + di]`` key rows. The attention over
the selected keys is the ``sparse_attention`` catalog surface: its Triton backend loads the
selected latent rows by index and runs the whole row in one call (the selection of every
chunk is made first); the indexer KL still gathers the ``[B, C, top_k, di]`` index keys.
When ``top_k`` covers every key the selection keeps all allowed keys, so the layer takes the
dense path (same result, no gather).
V3.2's FP8 indexer and Hadamard rotation are precision tricks for its kernels; this
reference computes the indexer in float32 (float64 for float64 models). Its key norm is our
RMSNorm (V3.2 uses LayerNorm).

Index cache (``[dsa] index_from``): a DSA layer may reuse the top-k selection an earlier DSA
layer made in the same forward instead of running an indexer of its own (it pays where
neighbouring layers would pick similar keys). A reusing layer has no indexer: no
parameters, no ``index_k`` in its paged cache, no indexer FLOPs and no KL. Its source writes
each chunk's ``(indices, valid)`` to an :class:`IndexCache`, cleared at the start of every
forward of the source; the reusing layer looks the chunk up by its rows, batch size, key count
and path (full forward or paged). When no valid entry exists (the source did not run in this
forward, ran dense, or ran a different shape or path) the reusing layer attends to every
allowed key -- the exact attention its sparse path approximates, the one selection it can make
without an indexer -- and counts the miss in ``index_cache_misses``. Reused indices are
re-masked with the layer's own ``allowed``, so a reusing layer never attends to a key it may
not see.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from megacpp.errors import ConfigError
from megacpp.kernels.ops.sparse_attention import (
    allowed_keys,
    gather_keys,
    indexer_kl_to_target,
    indexer_scores,
    latent_attention,
    select_topk,
)
from megacpp.kernels.runtime import resolve
from megacpp.model.cache import PagedView
from megacpp.model.config import DSA_MODES, ModelConfig
from megacpp.model.mixer import Mixer
from megacpp.model.mla import MultiHeadLatentAttention
from megacpp.model.norm import RMSNorm
from megacpp.model.rope import apply_rope

log = logging.getLogger(__name__)


class LightningIndexer(nn.Module):
    """The indexer's projections: ``n_heads`` index heads of ``head_dim``; RoPE on the first
    ``rope_dim`` dims of queries and keys (V3.2's indexer uses the half-split layout too)."""

    def __init__(
        self,
        d_model: int,
        q_in_dim: int,
        n_heads: int,
        head_dim: int,
        rope_dim: int,
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = n_heads, head_dim, rope_dim
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(q_in_dim, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, head_dim, bias=False)
        self.k_norm = RMSNorm(head_dim, norm_eps)
        self.weights_proj = nn.Linear(d_model, n_heads, bias=False)

    def queries(self, x: Tensor, q_in: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """-> index queries [B, L, Hi, di] and head weights [B, L, Hi]."""
        B, L, _ = x.shape
        q = self.q_proj(q_in).view(B, L, self.n_heads, self.head_dim)
        weights = self.weights_proj(x) * self.n_heads**-0.5
        # cos/sin [L, dr/2] (or [B, L, dr/2] for per-row positions) -> broadcast over heads
        return self._rope(q, cos.unsqueeze(-2), sin.unsqueeze(-2)), weights

    def keys(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """-> index keys [B, L, di]."""
        return self._rope(self.k_norm(self.k_proj(x)), cos, sin)

    def _rope(self, t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        rotated, rest = t.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([apply_rope(rotated, cos, sin), rest], dim=-1)

    def flops_per_token(self, seq_len: int, q_in_dim: int) -> int:
        """Projections plus scoring ``seq_len`` keys (q.k and the head-weighted sum)."""
        d_model = self.k_proj.in_features
        proj = 2 * q_in_dim * self.n_heads * self.head_dim + 2 * d_model * (
            self.head_dim + self.n_heads
        )
        return proj + self.score_flops(seq_len)

    def score_flops(self, n_keys: int) -> int:
        return 2 * n_keys * self.n_heads * (self.head_dim + 1)


class _Queries(NamedTuple):
    latent: Tensor  # [B, L, H, r]   no-RoPE query part with W_UK folded in
    rope: Tensor  # [B, L, H, dr]
    index: Tensor | None  # [B, L, Hi, di]  (None: a layer that reuses indices)
    index_weights: Tensor | None  # [B, L, Hi]

    def rows(self, rows: slice) -> _Queries:
        return _Queries(*(None if t is None else t[:, rows] for t in self))


class _Keys(NamedTuple):
    latent: Tensor  # [B, T, r] or, once shaped per query, [B, C|1, K, r]
    rope: Tensor  # [B, T, dr] / [B, C|1, K, dr]
    index: Tensor | None  # [B, T, di] / [B, C|1, K, di]  (None: a layer that reuses indices)

    def shared(self) -> _Keys:
        """Every key for every query: [B, 1, T, d]."""
        return _Keys(*(None if t is None else t[:, None] for t in self))

    def picked(self, indices: Tensor) -> _Keys:
        """The keys each query picked: [B, C, k, d]."""
        return _Keys(*(None if t is None else gather_keys(t, indices) for t in self))


class IndexCache:
    """The top-k selections a DSA layer made in its current forward, chunk by chunk, for the
    later layers that reuse them (``[dsa] index_from``).

    An entry is keyed by what makes a selection valid for another layer of the same forward:
    the chunk's query rows, the batch size, the number of keys, the device and the path
    (``"full"`` forward or ``"paged"``). The owning layer clears the cache when each of its
    forwards starts, so an entry is never from an older forward of the owner. A plain Python
    object, not a module: it holds no parameters and is never saved."""

    def __init__(self) -> None:
        # (key, indices, valid) per chunk, a list changed in place: under torch.compile a dict
        # mutated in a traced frame makes dynamo refuse the catalog's read-only mappings
        # (``resolve``) later in that frame
        self._entries: list[tuple[tuple, Tensor, Tensor]] = []

    def clear(self) -> None:
        self._entries.clear()

    def store(self, key: tuple, indices: Tensor, valid: Tensor) -> None:
        self._entries.append((key, indices, valid))

    def lookup(self, key: tuple) -> tuple[Tensor, Tensor] | None:
        for entry_key, indices, valid in self._entries:
            if entry_key == key:
                return indices, valid
        return None

    def __len__(self) -> int:
        return len(self._entries)


class DeepSeekSparseAttention(Mixer):
    """DSA mixer ``[B, L, d_model] -> [B, L, d_model]`` around an MLA module ``attn``.

    ``indexer`` is None in a layer that reuses another layer's selection
    (:meth:`reuse_indices_of`); ``index_cache`` is set on a layer others reuse."""

    def __init__(
        self,
        attn: MultiHeadLatentAttention,
        index_n_heads: int,
        index_head_dim: int,
        top_k: int,
        mode: str = "sparse",
        indexer_loss_coef: float = 1.0,
        query_chunk: int = 128,
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        _check_mode(mode)
        self.attn = attn
        d_model = attn.kv_down.in_features
        self.indexer: LightningIndexer | None = LightningIndexer(
            d_model, attn.q_in_dim, index_n_heads, index_head_dim, attn.rope_dim, norm_eps
        )
        self.top_k, self.mode = top_k, mode
        self.indexer_loss_coef, self.query_chunk = indexer_loss_coef, query_chunk
        self.aux_loss: Tensor | None = None
        self.index_cache: IndexCache | None = None  # written here, read by reusing layers
        self.index_source: IndexCache | None = None  # the source's cache (a reusing layer)
        self.index_cache_misses = 0  # chunks a reusing layer attended densely (no entry)

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> DeepSeekSparseAttention:
        d = cfg.dsa
        return cls(
            MultiHeadLatentAttention.from_config(cfg),
            index_n_heads=d.index_n_heads,
            index_head_dim=d.index_head_dim,
            top_k=d.top_k,
            mode=d.mode,
            indexer_loss_coef=d.indexer_loss_coef,
            query_chunk=d.query_chunk,
            norm_eps=cfg.norm_eps,
        )

    # -- the index cache ---------------------------------------------------------------------
    def reuse_indices_of(self, source: Mixer) -> None:
        """Make this layer reuse ``source``'s top-k selection: its own indexer is dropped (no
        parameters, no ``index_k`` cache entry). ``source`` must be a DSA layer with an
        indexer of its own and the same ``top_k`` and ``query_chunk``."""
        if not isinstance(source, DeepSeekSparseAttention) or source.indexer is None:
            what = type(source).__name__ if not isinstance(source, DeepSeekSparseAttention) \
                else "a DSA layer that reuses indices itself"
            raise ConfigError(f"dsa.index_from: a layer can reuse the indices of an A:dsa layer "
                              f"with its own indexer only, not of {what}")
        if (source.top_k, source.query_chunk) != (self.top_k, self.query_chunk):
            raise ConfigError("dsa.index_from: the source layer's top_k and query_chunk must "
                              "equal the reusing layer's")
        if source.index_cache is None:
            source.index_cache = IndexCache()
        self.indexer = None
        self.index_source = source.index_cache

    # -- forward -----------------------------------------------------------------------------
    def forward(
        self, x: Tensor, doc_ids: Tensor | None = None, again: tuple[Tensor, ...] = ()
    ) -> Tensor:
        """x [B, L, D] -> [B, L, D] (training, full forward)."""
        if self.index_cache is not None:
            self.index_cache.clear()
        L = x.shape[1]
        positions = torch.arange(L, device=x.device)
        cos, sin = self.attn.rope_tables(0, L, x)
        q_nope, q_rope, q_in = self.attn.queries(x, cos, sin)
        latent, k_rope = self.attn.compress_kv(x, cos, sin)
        index_q = index_w = index_k = None
        if self.indexer is not None:
            index_q, index_w = self.indexer.queries(x.detach(), q_in.detach(), cos, sin)
            index_k = self.indexer.keys(x.detach(), cos, sin)
        queries = _Queries(self.attn.absorb_query(q_nope), q_rope, index_q, index_w)
        keys = _Keys(latent, k_rope, index_k)

        chunks = []  # (rows, queries, allowed [B|1, C, L], selection or None) per chunk
        for rows in self._chunks(L):
            query_doc = doc_ids[:, rows] if doc_ids is not None else None
            allowed = allowed_keys(positions[rows], L, query_doc, doc_ids)
            q = queries.rows(rows)
            where = ("full", rows.start, rows.stop)
            chunks.append((rows, q, allowed, self._selection(q, keys, allowed, where)))
        backend = resolve("sparse_attention", queries.latent)
        if backend.role != "fallback" and all(c[3] is not None for c in chunks):
            o_latent, kl = self._attend_whole(backend.fn, queries, keys, chunks)
        else:  # the reference, or a chunk to attend densely: chunk by chunk
            parts = [self._attend_chunk(q, keys, allowed, sel) for _, q, allowed, sel in chunks]
            o_latent = torch.cat([o for o, _ in parts], dim=1)
            kl = [chunk_kl for _, chunk_kl in parts]
        self.aux_loss = None
        if self.training and self.indexer is not None:
            self.aux_loss = self.indexer_loss_coef * torch.cat(kl, dim=1).mean()
        return self.attn.output_from_latent(o_latent)

    def forward_paged(
        self, x: Tensor, cache: PagedView, again: tuple[Tensor, ...] = ()
    ) -> Tensor:
        """Rows at their own positions over the paged cache (latents, RoPE keys, index keys).

        Keys past a row's position (other rows' longer histories, unused block entries) are
        never allowed, so never picked as valid; indexer ties go to the earlier key."""
        if self.index_cache is not None:
            self.index_cache.clear()
        cos, sin = self.attn.paged_rope_tables(cache, x.dtype)  # [B, L, dr/2]
        q_nope, q_rope, q_in = self.attn.queries(x, cos, sin)
        latent, k_rope = self.attn.compress_kv(x, cos, sin)
        index_q = index_w = None
        if self.indexer is None:
            keys = _Keys(*cache.append(latent=latent, k_rope=k_rope), None)  # [B, T, d]
        else:
            index_q, index_w = self.indexer.queries(x, q_in, cos, sin)
            index_k = self.indexer.keys(x, cos, sin)
            keys = _Keys(*cache.append(latent=latent, k_rope=k_rope, index_k=index_k))
        queries = _Queries(self.attn.absorb_query(q_nope), q_rope, index_q, index_w)
        allowed = cache.batch.allowed_keys(keys.latent.shape[1])  # [B, L, T]
        outputs = []
        for rows in self._chunks(x.shape[1]):
            q, where = queries.rows(rows), ("paged", rows.start, rows.stop)
            selection = self._selection(q, keys, allowed[:, rows], where, stable=True)
            outputs.append(self._attend_chunk(q, keys, allowed[:, rows], selection)[0])
        return self.attn.output_from_latent(torch.cat(outputs, dim=1))

    def _chunks(self, length: int) -> Iterator[slice]:
        for start in range(0, length, self.query_chunk):
            yield slice(start, min(start + self.query_chunk, length))

    def _selection(
        self, q: _Queries, keys: _Keys, allowed: Tensor, where: tuple, stable: bool = False
    ) -> tuple[Tensor, Tensor] | None:
        """The chunk's selection (indices, valid [B, C, k]), or None to attend densely (the
        warm-up, top_k covering every key, or a reusing layer without a cache entry).

        ``where`` (path, first row, end row) names the chunk in the index cache. ``stable``
        (decoding): equal indexer scores are broken toward the earlier position, so the
        selection does not depend on how many (disallowed) keys pad the row -- the relu makes
        exact ties (score 0) common, and ``topk``'s tie order varies with T."""
        if self.mode != "sparse" or self.top_k >= keys.latent.shape[1]:
            return None
        return self._select(q, keys, allowed, where, stable)

    def _attend_chunk(
        self, q: _Queries, keys: _Keys, allowed: Tensor, selection: tuple[Tensor, Tensor] | None
    ) -> tuple[Tensor, Tensor | None]:
        """One chunk of C queries over T keys -> o_latent [B, C, H, r], per-query KL [B, C]
        (None in eval mode and in a layer without an indexer): over the ``selection`` through
        the ``sparse_attention`` surface, or densely over every allowed key when None."""
        if selection is None:
            attended = keys.shared()
            o_latent, probs = latent_attention(
                q.latent, q.rope, attended.latent, attended.rope, allowed, self.attn.scale
            )
            if not self.training or self.indexer is None:
                return o_latent, None
            return o_latent, self._kl(q, attended.index, probs.detach().mean(dim=2), allowed)
        picked, valid = selection  # [B, C, k] key indices, valid flags
        want_probs = self.training and self.indexer is not None
        o_latent, target = resolve("sparse_attention", q.latent).fn(
            q.latent, q.rope, keys.latent, keys.rope, picked, valid, self.attn.scale, want_probs
        )
        if not want_probs:
            return o_latent, None
        return o_latent, self._kl(q, gather_keys(keys.index, picked), target, valid)

    def _attend_whole(
        self, attend, queries: _Queries, keys: _Keys, chunks: list
    ) -> tuple[Tensor, list[Tensor]]:
        """Every chunk's selection in one call of a fast ``sparse_attention`` backend (it
        makes nothing [B, C, k, r], so the whole row fits; one launch instead of one per
        chunk) -> o_latent [B, L, H, r] and the per-chunk KLs (training with an indexer)."""
        picked = torch.cat([sel[0] for *_, sel in chunks], dim=1)  # [B, L, k]
        valid = torch.cat([sel[1] for *_, sel in chunks], dim=1)
        want_probs = self.training and self.indexer is not None
        o_latent, target = attend(
            queries.latent, queries.rope, keys.latent, keys.rope, picked, valid,
            self.attn.scale, want_probs,
        )
        if not want_probs:
            return o_latent, []
        return o_latent, [self._kl(q, gather_keys(keys.index, sel[0]), target[:, rows], sel[1])
                          for rows, q, _, sel in chunks]

    def _kl(self, q: _Queries, index_keys: Tensor, target: Tensor, allowed: Tensor) -> Tensor:
        """Per-query indexer KL [B, C] toward ``target`` (the head-mean attention [B, C, K])
        over the attended index keys [B, C|1, K, di]."""
        index = indexer_scores(q.index, q.index_weights, index_keys, self.indexer.scale)
        return indexer_kl_to_target(target, index, allowed)

    def _select(
        self, q: _Queries, keys: _Keys, allowed: Tensor, where: tuple, stable: bool
    ) -> tuple[Tensor, Tensor] | None:
        """The chunk's top-k keys (indices [B, C, k], valid [B, C, k]): from the source's
        index cache in a reusing layer (None when it has no entry: attend densely), else
        from this layer's indexer (stored for the layers that reuse it)."""
        B, n_keys = keys.latent.shape[0], keys.latent.shape[1]
        key = (*where, B, n_keys, keys.latent.device)
        if self.indexer is None:
            entry = None if self.index_source is None else self.index_source.lookup(key)
            if entry is None:
                self._count_miss(where)
                return None
            picked = entry[0]
            # re-masked with this layer's own mask: never attend to a key it may not see
            return picked, allowed.expand(B, -1, -1).gather(-1, picked)
        with torch.no_grad():
            scores = indexer_scores(
                q.index, q.index_weights, keys.index[:, None], self.indexer.scale
            )
            select = select_topk_stable if stable else select_topk
            picked, valid = select(scores, allowed, self.top_k)
        if self.index_cache is not None:
            self.index_cache.store(key, picked, valid)
        return picked, valid

    def _count_miss(self, where: tuple) -> None:
        if self.index_cache_misses == 0:
            log.warning("DSA layer reusing indices found no cached selection for its %s "
                        "chunk (rows %d:%d); attending to every allowed key", *where)
        self.index_cache_misses += 1

    # -- decoding and accounting -------------------------------------------------------------
    def paged_layout(self) -> dict[str, tuple[int, ...]]:
        """Per-token cache entries of the paged layout: MLA's, plus the indexer key (none in
        a layer that reuses another layer's indices)."""
        if self.indexer is None:
            return self.attn.paged_layout()
        return {**self.attn.paged_layout(), "index_k": (self.indexer.head_dim,)}

    def cache_bytes_per_token(self, dtype: torch.dtype = torch.bfloat16) -> int:
        index = 0 if self.indexer is None else self.indexer.head_dim * dtype.itemsize
        return self.attn.cache_bytes_per_token(dtype) + index

    def residual_projections(self) -> list[Tensor]:
        return self.attn.residual_projections()

    def attended_keys(self, seq_len: int) -> int:
        """Keys each query attends to at ``seq_len`` (counted over the full row, like GQA)."""
        return min(self.top_k, seq_len) if self.mode == "sparse" else seq_len

    def flops_per_token(self, seq_len: int) -> int:
        """Forward matmul FLOPs per token of a *training* forward (indexer KL included).

        MLA projections + the absorbed attention over ``attended_keys`` keys (W_UK folded
        into the query, scores and output over the r + dr latent dims, W_UV per head) + the
        indexer scoring every key; the sparse path re-scores its picked keys for the KL. A
        layer that reuses indices has no indexer term."""
        a, H = self.attn, self.attn.n_heads
        keys = self.attended_keys(seq_len)
        absorb = 2 * H * a.nope_dim * a.kv_lora_rank + 2 * H * a.kv_lora_rank * a.v_dim
        attention = 2 * keys * H * (a.kv_lora_rank + a.rope_dim) + 2 * keys * H * a.kv_lora_rank
        indexer = 0
        if self.indexer is not None:
            indexer = self.indexer.flops_per_token(seq_len, a.q_in_dim)
            if keys < seq_len:
                indexer += self.indexer.score_flops(keys)
        return a.projection_flops_per_token() + absorb + attention + indexer


def share_indices(
    mixers: Sequence[Mixer], index_from: Sequence[int], stages: Sequence[int] | None = None
) -> None:
    """Link the DSA layers of a stack (``mixers``, in layer order; ``stages``: each layer's
    pipeline stage) per ``[dsa] index_from``: one entry per DSA layer, -1 for a layer with its
    own indexer, else the index of the layer whose selection it reuses. The config checks
    the list against its own pattern; this checks it again against the stack actually built
    (a model may be built from another plan), fail closed."""
    if not index_from:
        return
    dsa_layers = [i for i, m in enumerate(mixers) if isinstance(m, DeepSeekSparseAttention)]
    if len(index_from) != len(dsa_layers):
        raise ConfigError(f"dsa.index_from has {len(index_from)} entries; the stack has "
                          f"{len(dsa_layers)} A:dsa layer(s), one entry each")
    for layer, source in zip(dsa_layers, index_from, strict=True):
        if source < 0:
            continue
        if not 0 <= source < layer or (stages is not None and stages[source] != stages[layer]):
            raise ConfigError(f"dsa.index_from: layer {layer} cannot reuse layer {source}; "
                              "the source must be an earlier layer of the same stage")
        mixers[layer].reuse_indices_of(mixers[source])


def select_topk_stable(scores: Tensor, allowed: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """:func:`select_topk` with ties broken toward the lower key position (a stable sort), in
    the same order whatever the number of keys T: [B, C, T] scores -> indices, valid."""
    k = min(top_k, scores.shape[-1])
    masked = scores.masked_fill(~allowed, float("-inf"))
    indices = masked.sort(dim=-1, descending=True, stable=True).indices[..., :k]
    return indices, allowed.expand_as(scores).gather(-1, indices)


def indexer_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """The parameters of every lightning indexer in ``model`` (for V3.2's warm-up, which
    trains these alone with the rest of the model frozen)."""
    for module in model.modules():
        if isinstance(module, LightningIndexer):
            yield from module.parameters()


def set_dsa_mode(model: nn.Module, mode: str) -> None:
    """Switch every DSA layer of ``model`` to ``mode`` (e.g. from the dense warm-up to sparse
    training); the parameters are the same in both modes."""
    _check_mode(mode)
    for module in model.modules():
        if isinstance(module, DeepSeekSparseAttention):
            module.mode = mode


def _check_mode(mode: str) -> None:
    if mode not in DSA_MODES:
        raise ConfigError(
            f"dsa.mode = {mode!r} is invalid; allowed: {' or '.join(map(repr, DSA_MODES))}"
        )
