"""What the engine runs next: FCFS admission, continuous batching, chunked prefill, and
preemption by recompute.

A :class:`Sequence` is a request's tokens (prompt, then completion) and how many of them the
caches hold (``num_computed``). It is *prefilling* while ``num_computed < prefill_end``
(``prefill_end`` = its token count when it was admitted) and *decoding* after: each decode
step feeds its last token and samples the next.

One :meth:`Scheduler.schedule` round, in this order:

1. every decoding sequence (oldest first) gets room for one more token; when the blocks run
   out, the newest running sequence is preempted (its blocks and slot are freed and it goes
   back to the head of the waiting queue with prompt + generated tokens, to be recomputed);
2. prefilling sequences (oldest first) get up to ``prefill_chunk`` prompt tokens in total,
   with the same preemption rule;
3. waiting sequences are admitted (FCFS, no preemption) while a state slot, blocks for their
   first chunk and prefill budget remain.

The oldest running sequence can always proceed (everything newer can be preempted, and the
engine checks that one sequence at ``max_model_len`` fits), so the engine never deadlocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from megacpp.infer.cache_manager import CacheManager
from megacpp.infer.detokenize import IncrementalDetokenizer, StopText
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
class ScheduleOutput:
    prefills: list[PrefillChunk]
    decodes: list[Sequence]
    preempted: list[Sequence]

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(self, cache: CacheManager, max_num_seqs: int, prefill_chunk: int) -> None:
        self.cache = cache
        self.max_num_seqs, self.prefill_chunk = max_num_seqs, prefill_chunk
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

    def schedule(self) -> ScheduleOutput:
        out = ScheduleOutput([], [], [])
        self._schedule_decodes(out)
        budget = self._schedule_prefills(out, self.prefill_chunk)
        self._admit(out, budget)
        return out

    def _schedule_decodes(self, out: ScheduleOutput) -> None:
        for seq in list(self.running):
            ready = seq.running and not seq.prefilling
            if ready and self._reserve(seq, seq.num_computed + 1, out):
                out.decodes.append(seq)

    def _schedule_prefills(self, out: ScheduleOutput, budget: int) -> int:
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.running and seq.prefilling:
                end = min(seq.prefill_end, seq.num_computed + budget)
                if self._reserve(seq, end, out):
                    out.prefills.append(PrefillChunk(seq, seq.num_computed, end))
                    budget -= end - seq.num_computed
        return budget

    def _admit(self, out: ScheduleOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            end = min(len(seq.token_ids), budget)
            if self.cache.slots.num_free == 0 or not self.cache.can_hold(seq.request_id, end):
                return
            self.waiting.popleft()
            self.cache.open_slot(seq.request_id)
            self.cache.reserve(seq.request_id, end)
            seq.num_computed, seq.prefill_end = 0, len(seq.token_ids)
            seq.running = True
            self.running.append(seq)
            out.prefills.append(PrefillChunk(seq, 0, end))
            budget -= end

    def _reserve(self, seq: Sequence, n_tokens: int, out: ScheduleOutput) -> bool:
        """Room for ``n_tokens`` tokens of ``seq``, preempting the newest running sequences
        as needed; False when ``seq`` itself was preempted."""
        while not self.cache.reserve(seq.request_id, n_tokens):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, out: ScheduleOutput) -> None:
        self.running.remove(seq)
        seq.running = False
        self.cache.release(seq.request_id)
        seq.num_computed = seq.prefill_end = 0
        if seq in out.decodes:
            out.decodes.remove(seq)
        out.prefills = [c for c in out.prefills if c.seq is not seq]
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.preemptions += 1
