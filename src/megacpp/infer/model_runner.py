"""The model runner: one step's :class:`~megacpp.infer.scheduler.SchedulerOutput` in, one
sampled token per finished prompt and per decoding request out.

:meth:`ModelRunner.execute` turns the scheduled requests into the model's inputs -- token and
position tensors, the slot mapping (where each token's KV entry is written in the paged
pools), block tables (padded with the scratch block) and state slots -- runs
:meth:`HybridLM.forward_paged` over the engine's pools and samples:

* prefill chunks of equal length share one [B, L] forward (a burst of same-size prompts);
  rows are never padded, since padding would run the M/R recurrences over tokens that are not
  there. A token is sampled only after a prompt's last chunk.
* all decoding requests advance together in one [B, 1] forward where every row sits at its
  own position -- through the captured CUDA graphs (:mod:`megacpp.infer.graphs`) on CUDA with
  ``cuda_graphs``, eagerly otherwise.

Sampling is per request (its own ``torch.Generator``, one uniform draw per token), batched in
one pass; greedy is exact argmax. The runner reads the cache manager's pools and geometry
(block size, scratch block) but never its ownership: which blocks and slot a request holds
comes with the scheduler output.

A model with a structure-id embedding reads each scheduled token's structure id (computed by
the engine, :mod:`megacpp.infer.structure`); a model with a hashed n-gram branch reads the
``max(orders) - 1`` tokens before each row's first token, taken from the sequence's tokens
(-1 before its start) -- in prefill and decode alike, so chunked prefill, preemption and
CUDA graphs see the same features as the training forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megacpp.infer.cache_manager import CacheManager
from megacpp.infer.graphs import DecodeGraphs, compiled_decode_fn
from megacpp.infer.sampling import sample_rows
from megacpp.infer.scheduler import ScheduledRequest, SchedulerOutput
from megacpp.infer.speculative import SpecStep, SpeculativeDecoder
from megacpp.model.cache import PagedBatch
from megacpp.model.model import HybridLM


@dataclass
class ModelRunnerOutput:
    """The tokens one step sampled, in sampling order (prefill groups, then decodes)."""

    request_ids: list[str]
    sampled_token_ids: list[int]  # one per request id
    # decoding rows that ran a speculative step (several tokens each; not in request_ids)
    speculative: dict[str, SpecStep] = field(default_factory=dict)


class ModelRunner:
    """Prepares the inputs, runs the model (CUDA graphs or eager) and samples; see the
    module docstring."""

    def __init__(
        self,
        model: HybridLM,
        cache: CacheManager,
        *,
        max_num_seqs: int,
        max_model_len: int,
        cuda_graphs: bool = True,
        compile_decode: bool = False,
    ) -> None:
        self.model, self.cache = model, cache
        self.device = cache.device
        self.uses_structure = model.structure_embed is not None
        self.context_len = 0 if model.ngram_embed is None else model.ngram_embed.context_len
        self.graphs: DecodeGraphs | None = None
        self.speculative: SpeculativeDecoder | None = None  # set by the engine (MTP drafts)
        if self.device.type == "cuda" and cuda_graphs:
            max_width = -(-max_model_len // cache.block_size)
            decode_fn = compiled_decode_fn(model) if compile_decode else None
            self.graphs = DecodeGraphs(model, cache, max_num_seqs, max_width, decode_fn)

    @torch.no_grad()
    def execute(self, scheduled: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step's prefill chunks and its batched decode; sample where asked."""
        sampled: list[tuple[str, int]] = []
        spec = self.speculative
        for group in _equal_length_groups(scheduled.prefills):
            logits = self._run_prefill(group)  # [len(group), V]
            done = [i for i, req in enumerate(group) if req.sample]
            group_sampled = self._sample([group[i] for i in done], logits[done]) if done else []
            if spec is not None:
                spec.after_prefill(group, dict(group_sampled))
            sampled += group_sampled
        decodes, speculated = scheduled.decodes, {}
        if spec is not None and decodes:
            speculated = spec.decode([r for r in decodes if spec.budget(r) > 0])
            decodes = [r for r in decodes if r.request_id not in speculated]
        if decodes:
            logits = self._run_decode(decodes)  # [B, V]
            sampled += self._sample(decodes, logits)
        return ModelRunnerOutput(
            request_ids=[rid for rid, _ in sampled],
            sampled_token_ids=[token for _, token in sampled],
            speculative=speculated,
        )

    # -- inputs and forward ----------------------------------------------------------------------
    def _run_prefill(self, chunks: list[ScheduledRequest]) -> torch.Tensor:
        """Chunks of equal length, one row each, through the model in one forward -> logits
        [len(chunks), V] at each row's last token."""
        dev = self.device
        ids = torch.tensor([c.token_ids for c in chunks], device=dev)
        positions = torch.stack([torch.arange(c.start, c.end, device=dev) for c in chunks])
        batch = PagedBatch(
            positions=positions,  # [B, L]
            slot_mapping=torch.cat([
                self._slot_mapping(c.block_table, row) for c, row in zip(chunks, positions)
            ]),
            block_tables=self._block_tables(chunks, max(c.end for c in chunks)),
            state_slots=torch.tensor([c.state_slot for c in chunks], device=dev),
            structure_ids=self._structure_ids(chunks),
            ngram_context=self._ngram_context(chunks),
        )
        hidden = self.model.residual_paged(ids, self.cache.layers, batch)  # [B, L, D]
        if self.speculative is not None:
            self.speculative.prefilled(chunks, hidden)
        return self.model.logits(self.model.norm(hidden[:, -1]))

    def _run_decode(self, rows: list[ScheduledRequest]) -> torch.Tensor:
        """Every decoding row's last token at its own position -> logits [B, V]."""
        bs = self.cache.block_size
        ids = [r.token_ids[0] for r in rows]
        pos = [r.start for r in rows]
        slot_mapping = [r.block_table[p // bs] * bs + p % bs for r, p in zip(rows, pos)]
        state_slots = [r.state_slot for r in rows]
        if self.graphs is not None:
            tables = [r.block_table for r in rows]
            structure = [r.structure_ids[0] for r in rows] if self.uses_structure else None
            context = self._context_lists(rows) if self.context_len else None
            return self.graphs.run(ids, pos, slot_mapping, state_slots, tables, structure,
                                   context)
        dev = self.device
        batch = PagedBatch(
            positions=torch.tensor(pos, device=dev)[:, None],
            slot_mapping=torch.tensor(slot_mapping, device=dev),
            block_tables=self._block_tables(rows, max(pos) + 1),
            state_slots=torch.tensor(state_slots, device=dev),
            structure_ids=self._structure_ids(rows),
            ngram_context=self._ngram_context(rows),
        )
        return self.model.forward_paged(torch.tensor(ids, device=dev)[:, None], self.cache.layers,
                                        batch)

    def _structure_ids(self, rows: list[ScheduledRequest]) -> torch.Tensor | None:
        """[B, L] structure ids of the rows' tokens, or None (the model does not read them)."""
        if not self.uses_structure:
            return None
        return torch.tensor([r.structure_ids for r in rows], device=self.device)

    def _context_lists(self, rows: list[ScheduledRequest]) -> list[list[int]]:
        """Per row, the ``context_len`` tokens before its first token (-1 before the start)."""
        C, contexts = self.context_len, []
        for r in rows:
            before = r.history[max(0, r.start - C) : r.start]
            contexts.append([-1] * (C - len(before)) + before)
        return contexts

    def _ngram_context(self, rows: list[ScheduledRequest]) -> torch.Tensor | None:
        """[B, context_len] n-gram context of each row, or None (no n-gram branch)."""
        if not self.context_len:
            return None
        return torch.tensor(self._context_lists(rows), device=self.device)

    def _slot_mapping(self, block_table: list[int], positions: torch.Tensor) -> torch.Tensor:
        """Where each position's KV entry lives in the paged pools: block * size + offset."""
        table = torch.tensor(block_table, device=self.device)
        bs = self.cache.block_size
        return table[positions // bs] * bs + positions % bs

    def _block_tables(self, rows: list[ScheduledRequest], n_tokens: int) -> torch.Tensor:
        """[B, ceil(n_tokens / block_size)] block ids, padded with the scratch block."""
        width = -(-n_tokens // self.cache.block_size)
        tables = []
        for r in rows:
            table = r.block_table[:width]
            tables.append(table + [self.cache.null_block] * (width - len(table)))
        return torch.tensor(tables, device=self.device)

    # -- sampling --------------------------------------------------------------------------------
    def _sample(self, rows: list[ScheduledRequest], logits: torch.Tensor) -> list[tuple[str, int]]:
        """One token per row of ``logits`` [B, V], batched (a single host sync)."""
        if all(r.generator is None for r in rows):
            tokens = logits.argmax(-1)
        else:
            params = torch.tensor(
                [(r.params.temperature, r.params.top_p, _draw(r.generator)) for r in rows],
                dtype=torch.float64,
            ).to(self.device)
            top_k = torch.tensor([r.params.top_k for r in rows]).to(self.device)
            tokens = sample_rows(logits, params[:, 0], top_k, params[:, 1], params[:, 2])
        return list(zip([r.request_id for r in rows], tokens.tolist(), strict=True))


def _equal_length_groups(chunks: list[ScheduledRequest]) -> list[list[ScheduledRequest]]:
    """The step's prefill chunks grouped by length (first-seen order), so chunks of equal
    length -- a burst of same-size prompts -- share one forward."""
    groups: dict[int, list[ScheduledRequest]] = {}
    for chunk in chunks:
        groups.setdefault(len(chunk.token_ids), []).append(chunk)
    return list(groups.values())


def _draw(generator: torch.Generator | None) -> float:
    """The next uniform [0, 1) of a request's generator (0 for greedy requests)."""
    if generator is None:
        return 0.0
    return float(torch.rand((), generator=generator, dtype=torch.float64))
