"""The model runner: one step's :class:`~megacpp.infer.scheduler.SchedulerOutput` in, one
sampled token per finished prompt and per decoding request out.

:meth:`ModelRunner.execute` turns the scheduled requests into the model's inputs -- token and
position tensors, the slot mapping (where each token's KV entry is written in the paged
pools), block tables (padded with the scratch block) and state slots -- runs
:meth:`HybridLM.forward_paged` over the engine's pools and samples:

* prefill chunks (that want no prompt logprobs) run through the captured prefill graphs
  (:mod:`megacpp.infer.prefill_graphs`, CUDA with ``prefill_graphs``): a chunk that starts
  its sequence left-padded to a (batch, length) bucket, a continuation chunk (after a
  prefix-cache hit or an earlier chunk) right-padded to a (batch, length, width) bucket; any
  lengths in one replay. The other chunks (longer than the largest length bucket, asking
  for prompt logprobs, or making an MTP draft; every chunk off CUDA or without
  ``prefill_graphs``) share one eager [B, L] forward per length, never padded. A token is
  sampled only after a prompt's last chunk.
* all decoding requests advance together in one [B, 1] forward where every row sits at its
  own position -- through the captured CUDA graphs (:mod:`megacpp.infer.graphs`) on CUDA with
  ``cuda_graphs``, eagerly otherwise. Greedy rows with a pending MTP draft (speculative
  decoding) run the speculative step instead (:mod:`megacpp.infer.speculative`; captured by
  :mod:`megacpp.infer.spec_graphs` alongside the decode graphs).

Sampling is per request (its own ``torch.Generator``, one uniform draw per token), batched in
one pass; greedy is exact argmax. The runner reads the cache manager's pools and geometry
(block size, scratch block) but never its ownership: which blocks and slot a request holds
comes with the scheduler output.

A model with a structure-id embedding reads each scheduled token's structure id (computed by
the engine, :mod:`megacpp.infer.structure`); a model with a hashed n-gram branch reads the
``max(orders) - 1`` tokens before each row's first token, taken from the sequence's tokens
(-1 before its start) -- in prefill and decode alike, so chunked prefill, preemption and
CUDA graphs see the same features as the training forward.

Logprobs (:mod:`megacpp.infer.logprobs`), only for the requests that ask: a sampled token's
comes from the logits it was sampled from; prompt logprobs (``SamplingParams.prompt_logprobs``)
need the logits at every position of a prefill chunk, so chunks that ask run in their own
forwards with ``all_positions`` ([B, L, V] logits), and the others keep the last-token path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megacpp.infer.cache_manager import CacheManager
from megacpp.infer.graphs import DecodeGraphs, compiled_decode_fn
from megacpp.infer.logprobs import TokenLogprob, token_logprobs, truncated
from megacpp.infer.prefill_graphs import (
    ContinuationGraphs,
    PrefillGraphs,
    supports_prefill_graphs,
)
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
    # request id -> the sampled token's logprob (requests with SamplingParams.logprobs)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    # request id -> (t, entries for the known tokens t, t+1, ... that the chunk's positions
    # predict) for prefill chunks of requests with SamplingParams.prompt_logprobs
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
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
        prefill_graphs: bool = True,
        prefill_graph_tokens: int = 2048,
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
        self.prefill_graphs: PrefillGraphs | None = None
        self.continuation_graphs: ContinuationGraphs | None = None
        if self.device.type == "cuda" and prefill_graphs:
            if supports_prefill_graphs(model):
                self.prefill_graphs = PrefillGraphs(model, cache, max_num_seqs, max_model_len,
                                                    prefill_graph_tokens)
            self.continuation_graphs = ContinuationGraphs(model, cache, max_num_seqs,
                                                          max_model_len, prefill_graph_tokens)
            pool = torch.cuda.graph_pool_handle()  # one pool: the two never replay at once
            self.continuation_graphs.pool = pool
            if self.prefill_graphs is not None:
                self.prefill_graphs.pool = pool

    @torch.no_grad()
    def execute(self, scheduled: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step's prefill chunks and its batched decode; sample where asked."""
        sampled: list[tuple[str, int]] = []
        out = ModelRunnerOutput([], [])
        spec = self.speculative
        for group, run in self._prefill_groups(scheduled.prefills):
            scored = group[0].params.prompt_logprobs is not None  # eager groups only
            if scored:
                logits = self._run_prefill(group, all_positions=True)  # [B, L, V]
                out.prompt_logprobs.update(self._prompt_logprobs(group, logits))
                logits = logits[:, -1]  # [B, V]: equal-length rows, unpadded
            else:
                logits = run(group)  # [B, V]
            done = [i for i, req in enumerate(group) if req.sample]
            group_sampled = []
            if done:
                group_sampled = self._sample([group[i] for i in done], logits[done],
                                             out.logprobs)
                sampled += group_sampled
            if spec is not None:  # the MTP module's cache, and a draft after a last chunk
                spec.after_prefill(group, dict(group_sampled))
        decodes = scheduled.decodes
        if spec is not None and decodes:
            out.speculative = spec.decode([r for r in decodes if spec.budget(r) > 0])
            decodes = [r for r in decodes if r.request_id not in out.speculative]
        if decodes:
            logits = self._run_decode(decodes)  # [B, V]
            sampled += self._sample(decodes, logits, out.logprobs)
        out.request_ids = [rid for rid, _ in sampled]
        out.sampled_token_ids = [token for _, token in sampled]
        return out

    def _prefill_groups(self, chunks: list[ScheduledRequest]) -> list[tuple[list, object]]:
        """The step's prefill chunks as (group, runner): the first-chunk graphs' groups, the
        continuation graphs' groups, then the rest grouped by equal length for the eager
        forward."""
        families = [g for g in (self.prefill_graphs, self.continuation_graphs) if g is not None]
        # prompt logprobs need every position's logits, and speculating requests the main
        # stack's output for the MTP module: those chunks prefill eagerly, as do chunks no
        # bucket holds (longer than the largest length bucket)
        spec = self.speculative
        out, rest = [], []
        taken: list[list[ScheduledRequest]] = [[] for _ in families]
        for c in chunks:
            eager = c.params.prompt_logprobs is not None or (spec is not None and spec.wants(c))
            family = None if eager else next(
                (i for i, g in enumerate(families) if g.takes(c)), None)
            (rest if family is None else taken[family]).append(c)
        for graphs, mine in zip(families, taken, strict=True):
            out += [(g, graphs.run) for g in graphs.groups(mine)]
        return out + [(g, self._run_prefill) for g in _equal_length_groups(rest)]

    # -- inputs and forward ----------------------------------------------------------------------
    def _run_prefill(self, chunks: list[ScheduledRequest], all_positions: bool = False
                     ) -> torch.Tensor:
        """Chunks of equal length, one row each, through the model in one forward -> logits
        [len(chunks), V] at each row's last token (``all_positions``: [len(chunks), L, V])."""
        dev, bs = self.device, self.cache.block_size
        ids = torch.tensor([c.token_ids for c in chunks], device=dev)
        starts = torch.tensor([c.start for c in chunks], device=dev)
        positions = starts[:, None] + torch.arange(ids.shape[1], device=dev)  # [B, L]
        tables = self._block_tables(chunks, max(c.end for c in chunks))  # [B, W]
        batch = PagedBatch(
            positions=positions,
            # where each position's KV entry lives (block * size + offset): a handful of
            # kernels for all rows, not a host-to-device copy and four kernels per row
            slot_mapping=(tables.gather(1, positions // bs) * bs + positions % bs).flatten(),
            block_tables=tables,
            state_slots=torch.tensor([c.state_slot for c in chunks], device=dev),
            structure_ids=self._structure_ids(chunks),
            ngram_context=self._ngram_context(chunks),
        )
        hidden = self.model.residual_paged(ids, self.cache.layers, batch)  # [B, L, D]
        if self.speculative is not None:
            self.speculative.prefilled(chunks, hidden)
        return self.model.logits(self.model.norm(hidden if all_positions else hidden[:, -1]))

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

    def _block_tables(self, rows: list[ScheduledRequest], n_tokens: int) -> torch.Tensor:
        """[B, ceil(n_tokens / block_size)] block ids, padded with the scratch block."""
        width = -(-n_tokens // self.cache.block_size)
        tables = []
        for r in rows:
            table = r.block_table[:width]
            tables.append(table + [self.cache.null_block] * (width - len(table)))
        return torch.tensor(tables, device=self.device)

    # -- sampling --------------------------------------------------------------------------------
    def _sample(self, rows: list[ScheduledRequest], logits: torch.Tensor,
                logprobs: dict[str, TokenLogprob]) -> list[tuple[str, int]]:
        """One token per row of ``logits`` [B, V], batched (a single host sync); the rows that
        ask for logprobs get theirs in ``logprobs``."""
        if all(r.generator is None for r in rows):
            tokens = logits.argmax(-1)
        else:
            params = torch.tensor(
                [(r.params.temperature, r.params.top_p, _draw(r.generator)) for r in rows],
                dtype=torch.float64,
            ).to(self.device)
            top_k = torch.tensor([r.params.top_k for r in rows]).to(self.device)
            tokens = sample_rows(logits, params[:, 0], top_k, params[:, 1], params[:, 2])
        scored = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if scored:
            k = max(rows[i].params.logprobs for i in scored)
            entries = token_logprobs(logits[scored], tokens[scored], k)
            for i, entry in zip(scored, entries, strict=True):
                logprobs[rows[i].request_id] = truncated(entry, rows[i].params.logprobs)
        return list(zip([r.request_id for r in rows], tokens.tolist(), strict=True))

    def _prompt_logprobs(self, chunks: list[ScheduledRequest], logits: torch.Tensor
                         ) -> dict[str, tuple[int, list[TokenLogprob]]]:
        """Per chunk, the logprobs of the tokens its positions predict, as far as the
        sequence's tokens are known (a prompt's last position predicts the sampled token,
        which is not a prompt token). ``logits`` [B, L, V]."""
        out = {}
        for req, row_logits in zip(chunks, logits, strict=True):
            targets = req.history[req.start + 1 : req.end + 1]  # tokens start+1 .. end
            if targets:
                entries = token_logprobs(row_logits[: len(targets)],
                                         torch.tensor(targets, device=self.device),
                                         req.params.prompt_logprobs)
                out[req.request_id] = (req.start + 1, entries)
        return out


def _equal_length_groups(chunks: list[ScheduledRequest]) -> list[list[ScheduledRequest]]:
    """The step's prefill chunks grouped by length (first-seen order), so chunks of equal
    length -- a burst of same-size prompts -- share one forward; chunks that want prompt
    logprobs (all positions' logits) are grouped apart from those that do not."""
    groups: dict[tuple[int, bool], list[ScheduledRequest]] = {}
    for chunk in chunks:
        key = (len(chunk.token_ids), chunk.params.prompt_logprobs is not None)
        groups.setdefault(key, []).append(chunk)
    return list(groups.values())


def _draw(generator: torch.Generator | None) -> float:
    """The next uniform [0, 1) of a request's generator (0 for greedy requests)."""
    if generator is None:
        return 0.0
    return float(torch.rand((), generator=generator, dtype=torch.float64))
