"""Input features added to the token embedding, each config-gated and off by default.

* **Structure-id embedding** (``[structure] embedding = true``): one learned vector per
  tree-sitter structure id (``megacpp.data.structure.Structure``: comment, string, function
  body, ...) of each token. Training reads the ids the data build stored in the shards; the
  serving engine computes them for prompts and generated tokens with the same labeler
  (``megacpp.infer.structure``). Cost: ``NUM_STRUCTURE_IDS x d_model`` parameters, one gather
  and one add per token.
* **Hashed n-gram embedding** (``[ngram] orders = [2, 3]``, Engram-style): for each order n,
  the token and its n-1 predecessors (in the same document) are hashed into a table of
  ``table_size`` rows of d_model; the rows of all orders are added to the token embedding.
  Cost: ``len(orders) x table_size x d_model`` parameters (AdamW, like the token embedding),
  ``len(orders)`` gathers per token. Decoding needs each row's previous ``max(orders) - 1``
  tokens: :attr:`PagedBatch.ngram_context <megacpp.model.cache.PagedBatch>`.

Both tables start at zero, so a model with a feature switched on computes, at step 0, the
same function as one without it; the tables learn from there (an embedding's gradient does
not depend on its value).
"""

from __future__ import annotations

import torch
from torch import nn

from megacpp.model.config import ModelConfig

# ``len(megacpp.data.structure.Structure)``; model never imports data (a test checks they agree)
NUM_STRUCTURE_IDS = 9
NO_TOKEN = -1  # a context position with no token (before the sequence's start)


def ngram_multipliers(orders: tuple[int, ...], seed: int) -> torch.Tensor:
    """int64[len(orders), max(orders)]: the odd 31-bit multiplier of each (order, offset),
    drawn by splitmix64 from ``seed`` (plain Python: the same numbers on every device)."""
    state = seed & 0xFFFFFFFFFFFFFFFF
    rows = []
    for _ in orders:
        row = []
        for _ in range(max(orders)):
            state = (state + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
            z = state
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
            z ^= z >> 31
            row.append((z & 0x7FFFFFFF) | 1)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64)


class HashedNgramEmbedding(nn.Module):
    """Sum over orders n of ``table_n[hash_n(t[i-n+1..i])]``: input ids [B, L] -> [B, L, D].

    ``hash_n`` XORs ``(t[i-j] + 1) * m[n, j]`` over offsets j = 0..n-1 (m: fixed odd 31-bit
    multipliers from ``hash_seed``), modulo ``table_size``. A predecessor that is missing --
    before the row's start with no context, or in another document -- enters as 0 (token ids
    are < 2^20, so every product stays below 2^52: exact in int64)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        ng = cfg.ngram
        self.orders, self.table_size = tuple(ng.orders), ng.table_size
        self.context_len = max(self.orders) - 1  # predecessors a decode step needs
        self.tables = nn.ModuleList(_zero_embedding(ng.table_size, cfg.d_model)
                                    for _ in self.orders)
        self.hash_seed = ng.hash_seed
        self.register_buffer("multipliers", ngram_multipliers(self.orders, ng.hash_seed),
                             persistent=False)

    @torch.no_grad()
    def reset_multipliers(self) -> None:
        """Recompute the hash multipliers (a buffer not saved: for a module materialised
        from the meta device, as transformers loads an export)."""
        values = ngram_multipliers(self.orders, self.hash_seed)
        self.multipliers.copy_(values.to(self.multipliers.device))

    def reset_parameters(self) -> None:
        for table in self.tables:
            nn.init.zeros_(table.weight)

    def hash_ids(
        self,
        input_ids: torch.Tensor,
        context: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """int64[n_orders, B, L] table row of each order at each token.

        ``context`` [B, context_len]: the tokens before each row's first token, oldest first
        (``NO_TOKEN`` where there is none); None: no predecessors. ``doc_ids`` [B, L]: a
        predecessor in another document is missing (the context counts as the first token's
        document)."""
        B, L = input_ids.shape
        C = self.context_len
        if context is None:
            context = input_ids.new_full((B, C), NO_TOKEN)
        elif context.shape != (B, C):
            raise ValueError(f"ngram context must be [{B}, {C}], got {list(context.shape)}")
        tokens = torch.cat([context.to(input_ids.dtype), input_ids], dim=1) + 1  # [B, C + L]
        if doc_ids is not None:
            ext_doc = torch.cat([doc_ids[:, :1].expand(B, C), doc_ids], dim=1)  # [B, C + L]
        hashes = []
        for k, n in enumerate(self.orders):
            h = torch.zeros_like(input_ids)
            for j in range(n):
                shifted = tokens[:, C - j : C - j + L]  # t[i - j] + 1 (0: missing)
                if doc_ids is not None and j > 0:
                    same_doc = ext_doc[:, C - j : C - j + L] == doc_ids
                    shifted = shifted * same_doc
                h = h ^ (shifted * self.multipliers[k, j])
            hashes.append(h % self.table_size)
        return torch.stack(hashes)

    def forward(
        self,
        input_ids: torch.Tensor,
        context: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rows = self.hash_ids(input_ids, context, doc_ids)  # [n_orders, B, L]
        out = self.tables[0](rows[0])  # [B, L, D]
        for table, ids in zip(self.tables[1:], rows[1:], strict=True):
            out = out + table(ids)
        return out

    def next_context(self, context: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor:
        """The context after ``input_ids`` [B, L]: the last ``context_len`` tokens of
        ``context`` then ``input_ids``."""
        B = input_ids.shape[0]
        if context is None:
            context = input_ids.new_full((B, self.context_len), NO_TOKEN)
        return torch.cat([context.to(input_ids.dtype), input_ids], dim=1)[:, -self.context_len:]


def structure_embedding(cfg: ModelConfig) -> nn.Embedding | None:
    """The structure-id table (zero-initialised), or None when ``[structure] embedding`` is
    off."""
    if not cfg.structure.embedding:
        return None
    return _zero_embedding(NUM_STRUCTURE_IDS, cfg.d_model)


def _zero_embedding(rows: int, dim: int) -> nn.Embedding:
    """A zero table, made without drawing random numbers: a model with a feature on draws
    the same initial weights for everything else as one without it (same seed), so an
    ablation compares the feature alone."""
    return nn.Embedding(rows, dim, _weight=torch.zeros(rows, dim))


def ngram_embedding(cfg: ModelConfig) -> HashedNgramEmbedding | None:
    return HashedNgramEmbedding(cfg) if cfg.ngram.orders else None
