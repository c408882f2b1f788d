"""What the engine runs next: FCFS admission, continuous batching, chunked prefill, and
preemption by recompute.

A :class:`Sequence` is a request's tokens (prompt, then completion) and how many of them the
caches hold (``num_computed``). It is *prefilling* while ``num_computed < prefill_end``
(``prefill_end`` = its token count when it was admitted) and *decoding* after: each decode
step feeds its last token and samples the next.

One :meth:`Scheduler.schedule` round, in this order:

1. every decoding sequence (oldest first) gets room for one more token (a greedy one, with
   speculative decoding on, for ``lookahead`` more: its drafts); when the blocks run
   out, the newest running sequence is preempted (its blocks and slot are freed and it goes
   back to the head of the waiting queue with prompt + generated tokens, to be recomputed);
2. prefilling sequences (oldest first) get up to ``prefill_chunk`` prompt tokens in total,
   with the same preemption rule;
3. waiting sequences are admitted (FCFS, no preemption) while a state slot, blocks for their
   first chunk and prefill budget remain. With prefix caching a sequence starts after the
   longest cached prefix of its tokens (:mod:`megacpp.infer.prefix_cache`; not a request for
   prompt logprobs, which needs every prompt position computed), and a model with
   M/R layers has its prefill chunks cut at the cache's snapshot boundaries.

The oldest running sequence can always proceed (everything newer can be preempted, and the
engine checks that one sequence at ``max_model_len`` fits), so the engine never deadlocks.

The round's result is a :class:`SchedulerOutput`: for each request that runs, the tokens it
feeds, their first position, its block table and state slot, and whether a token is sampled
after them. The model runner (:mod:`megacpp.infer.model_runner`) needs nothing else; the
engine then advances ``num_computed`` and appends the sampled tokens.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

import torch

from megacpp.infer.cache_manager import CacheManager
from megacpp.infer.detokenize import IncrementalDetokenizer, StopText
from megacpp.infer.prefix_cache import NO_HIT
from megacpp.infer.sampling import SamplingParams


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_len: int
    token_ids: list[int]  # prompt, then completion
    params: SamplingParams
    generator: torch.Generator | None
    detok: IncrementalDetokenizer
    stop_text: StopText
    num_computed: int = 0  # tokens whose cache entries are written
    prefill_end: int = 0  # prefill until num_computed reaches this
    running: bool = False  # admitted (holds a slot and blocks), not preempted or finished
    structure_ids: list[int] | None = None  # per token, for a structure-embedding model
    block_hashes: tuple[bytes, ...] = ()  # chained hashes of its full blocks, once looked up

    @property
    def completion_len(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.prefill_end


@dataclass
class PrefillChunk:
    seq: Sequence
    start: int  # token_ids[start:end] are computed by this chunk
    end: int

    @property
    def completes(self) -> bool:
        return self.end == self.seq.prefill_end


@dataclass
class _Plan:
    """The round while it is being decided (preemption can still drop entries)."""

    prefills: list[PrefillChunk]
    decodes: list[Sequence]
    preempted: list[Sequence]


@dataclass(eq=False, slots=True)
class ScheduledRequest:
    """One request's work in one step: feed ``token_ids`` at positions ``start..end-1``,
    writing their KV into ``block_table``'s blocks and their M/R state into ``state_slot``."""

    request_id: str
    token_ids: list[int]  # a prefill chunk, or the last token when decoding
    start: int  # position of token_ids[0] (= the tokens already in the caches)
    block_table: list[int]  # the request's blocks in position order, covering end tokens
    state_slot: int
    sample: bool  # sample the next token after token_ids (decodes; a prompt's last chunk)
    params: SamplingParams
    generator: torch.Generator | None  # the request's own (None: greedy)
    structure_ids: list[int] | None = None  # of token_ids (a structure-embedding model)
    history: list[int] | None = None  # the sequence's tokens (live list): those before
    #                                   start are a hashed n-gram branch's context

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass
class SchedulerOutput:
    """What runs in one step, oldest request first in each list."""

    prefills: list[ScheduledRequest]  # prompt chunks, any length
    decodes: list[ScheduledRequest]  # one token each
    preempted: list[str]  # request ids sent back to the waiting queue this round

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(self, cache: CacheManager, max_num_seqs: int, prefill_chunk: int,
                 lookahead: int = 0, max_model_len: int = 2**31 - 1) -> None:
        self.cache = cache
        self.max_num_seqs, self.prefill_chunk = max_num_seqs, prefill_chunk
        # greedy decodes reserve room for this many more tokens (speculative drafts)
        self.lookahead, self.max_model_len = lookahead, max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: oldest first
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop ``seq`` wherever it is and free its cache (finish or abort)."""
        if seq.running:
            self.running.remove(seq)
            seq.running = False
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.cache.release(seq.request_id)

    def computed(self, seq: Sequence, end: int) -> None:
        """``seq``'s tokens up to ``end`` are in the caches (its step ran)."""
        if seq.prefilling:
            self.cache.computed(seq.request_id, seq.token_ids, seq.structure_ids, end)
        seq.num_computed = end

    def schedule(self) -> SchedulerOutput:
        self.cache.flush()  # the last step's snapshots, before any slot is reused or advanced
        plan = _Plan([], [], [])
        self._schedule_decodes(plan)
        budget = self._schedule_prefills(plan, self.prefill_chunk)
        self._admit(plan, budget)
        self.cache.prepare_new_slots()  # the admitted slots' reset or snapshot, all at once
        return SchedulerOutput(
            prefills=[self._scheduled(c.seq, c.start, c.end, c.completes) for c in plan.prefills],
            decodes=[self._scheduled(s, s.num_computed, s.num_computed + 1, True)
                     for s in plan.decodes],
            preempted=[s.request_id for s in plan.preempted],
        )

    def _scheduled(self, seq: Sequence, start: int, end: int, sample: bool) -> ScheduledRequest:
        rid = seq.request_id
        return ScheduledRequest(
            request_id=rid,
            token_ids=seq.token_ids[start:end],
            start=start,
            block_table=self.cache.tables[rid],  # the live table: read during this step only
            state_slot=self.cache.slot_of[rid],
            sample=sample,
            params=seq.params,
            generator=seq.generator,
            structure_ids=None if seq.structure_ids is None else seq.structure_ids[start:end],
            history=seq.token_ids,
        )

    def _schedule_decodes(self, plan: _Plan) -> None:
        for seq in list(self.running):
            ready = seq.running and not seq.prefilling
            extra = self.lookahead if seq.generator is None else 0
            room = min(seq.num_computed + 1 + extra, max(self.max_model_len, seq.num_computed + 1))
            if ready and self._reserve(seq, room, plan):
                plan.decodes.append(seq)

    def _schedule_prefills(self, plan: _Plan, budget: int) -> int:
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.running and seq.prefilling:
                end = self.cache.chunk_end(seq.request_id, seq.num_computed,
                                           min(seq.prefill_end, seq.num_computed + budget),
                                           seq.prefill_end)
                if self._reserve(seq, end, plan):
                    plan.prefills.append(PrefillChunk(seq, seq.num_computed, end))
                    budget -= end - seq.num_computed
        return budget

    def _admit(self, plan: _Plan, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.cache.slots.num_free == 0:
                return
            n_tokens = len(seq.token_ids)
            if seq.params.prompt_logprobs is not None:  # scores every token: no cached start
                hit = NO_HIT
            else:
                hit = self.cache.match_prefix(seq.token_ids, seq.structure_ids, seq.block_hashes)
                seq.block_hashes = hit.hashes  # a request left waiting is not hashed again
            start = hit.num_tokens
            if not self.cache.can_admit(hit, min(n_tokens, start + budget)):
                return
            self.waiting.popleft()
            self.cache.admit(seq.request_id, hit, n_tokens)
            if any(_same_first_block(seq, other, self.cache.block_size)
                   for other in itertools.islice(self.waiting, self.max_num_seqs)):
                self.cache.expect_sharing(seq.request_id)
            end = self.cache.chunk_end(seq.request_id, start, min(n_tokens, start + budget),
                                       n_tokens)
            if not self.cache.reserve(seq.request_id, end):
                raise AssertionError(f"admitted {seq.request_id!r} without room for {end} tokens")
            seq.num_computed, seq.prefill_end = start, n_tokens
            seq.running = True
            self.running.append(seq)
            plan.prefills.append(PrefillChunk(seq, start, end))
            budget -= end - start

    def _reserve(self, seq: Sequence, n_tokens: int, plan: _Plan) -> bool:
        """Room for ``n_tokens`` tokens of ``seq``, preempting the newest running sequences
        as needed; False when ``seq`` itself was preempted."""
        while not self.cache.reserve(seq.request_id, n_tokens):
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, plan: _Plan) -> None:
        self.running.remove(seq)
        seq.running = False
        self.cache.release(seq.request_id)
        seq.num_computed = seq.prefill_end = 0
        if seq in plan.decodes:
            plan.decodes.remove(seq)
        plan.prefills = [c for c in plan.prefills if c.seq is not seq]
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)
        self.preemptions += 1


def _same_first_block(a: Sequence, b: Sequence, block_size: int) -> bool:
    """``a`` and ``b`` start with the same full block (tokens and structure ids)."""
    if len(a.token_ids) <= block_size or len(b.token_ids) <= block_size:
        return False
    if a.token_ids[:block_size] != b.token_ids[:block_size]:
        return False
    return a.structure_ids is None or a.structure_ids[:block_size] == \
        (b.structure_ids or [])[:block_size]
