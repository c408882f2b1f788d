"""The serving engine: continuous batching over the hybrid model's paged caches.

The engine schedules and coordinates; the model runner alone runs the model. One
``Engine.step()`` is

1. ``Scheduler.schedule()`` (:mod:`megacpp.infer.scheduler`) decides the round: which
   requests run, how many tokens each (a prefill chunk or one decode token), and which blocks
   and state slot each writes -- a :class:`~megacpp.infer.scheduler.SchedulerOutput`;
2. ``ModelRunner.execute()`` (:mod:`megacpp.infer.model_runner`) turns it into the model's
   inputs, runs the forward (CUDA graphs or eager) and samples -- a
   :class:`~megacpp.infer.model_runner.ModelRunnerOutput`;
3. :meth:`Engine.update_from_output` consumes the sampled tokens: it advances each request's
   computed tokens, appends the tokens, detokenizes, applies stop / EOS / length, and finishes
   requests (freeing their blocks and slot).

Sampling is per request (its own ``torch.Generator``, seeded when ``seed`` is set); greedy is
exact argmax, so a sequence's greedy tokens do not depend on what it was batched with (up to
floating-point summation order, which the float64 tests rule out).

With ``speculative_tokens`` k > 0, greedy requests decode by self-speculation
(:mod:`megacpp.infer.speculative`): the model's first multi-token-prediction module drafts k
tokens, one forward of the main stack verifies them, and a step appends the accepted drafts
plus the model's next token -- the same tokens as one-at-a-time greedy decoding. Without it the
``[mtp]`` modules are not used for serving. A model with a
structure-id embedding gets each token's tree-sitter structure id from
:mod:`megacpp.infer.structure` (prompt: one parse; each generated token: a parse of the
sequence so far); a hashed n-gram branch gets each row's previous tokens from the sequence.
The engine is single-threaded: one thread calls add_request / abort / step.

Logprobs (:mod:`megacpp.infer.logprobs`): with ``SamplingParams.logprobs`` each output carries
its token's logprob and top alternatives; with ``prompt_logprobs`` the request's first output
carries one entry per prompt token (None for the first, which nothing predicts). Prompt
entries are collected chunk by chunk as the prompt is prefilled; a recompute after
preemption does not add them twice, and a prompt position that was never computed is an error
(prompt logprobs need every prompt position run through the model).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megacpp.data.tokenizer import CppTokenizer
from megacpp.errors import ConfigError, MegaCppError
from megacpp.infer.cache_manager import CacheManager, default_num_blocks
from megacpp.infer.detokenize import IncrementalDetokenizer, StopText
from megacpp.infer.graphs import DecodeGraphs
from megacpp.infer.logprobs import TokenLogprob
from megacpp.infer.model_runner import ModelRunner, ModelRunnerOutput
from megacpp.infer.sampling import SamplingParams
from megacpp.infer.scheduler import Scheduler, SchedulerOutput, Sequence
from megacpp.infer.spec_graphs import SpecGraphs
from megacpp.infer.speculative import MAX_SPECULATIVE_TOKENS, SpecStep, SpeculativeDecoder
from megacpp.infer.structure import StructureIds
from megacpp.model.model import HybridLM


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 32  # running sequences at most (= state slots per M/R layer)
    block_size: int = 16  # tokens per KV block (attention / MLA latent pages)
    num_blocks: int | None = None  # KV blocks per attention layer; None: enough for
    #                                max_num_seqs * max_model_len tokens
    max_model_len: int = 2048  # prompt + completion tokens per sequence
    prefill_chunk: int = 2048  # prompt tokens prefilled per engine step (chunked prefill)
    max_waiting: int = 256  # bounded waiting queue; add_request raises QueueFull beyond it
    cuda_graphs: bool = True  # on CUDA: replay the decode step as captured CUDA graphs
    compile_decode: bool = False  # with cuda_graphs: torch.compile each block family's
    #                               decode step first (fewer kernels; slow first steps)
    prefill_graphs: bool = True  # on CUDA: replay prefill chunks as captured CUDA graphs,
    #                              first chunks per (batch, length) bucket, continuation
    #                              chunks per (batch, length, width) (infer/prefill_graphs.py)
    prefill_graph_tokens: int = 2048  # the largest captured prefill bucket (batch x length)
    speculative_tokens: int = 0  # greedy requests: MTP drafts verified per step (0: off)
    prefix_cache: bool = True  # reuse KV blocks and M/R state snapshots of shared prefixes
    prefix_snapshots: int | None = None  # M/R snapshot rows; None: 2 * max_num_seqs
    snapshot_interval: int = 512  # M/R snapshot grid in tokens (rounded up to whole blocks)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "block_size", "max_model_len", "prefill_chunk", "max_waiting",
                     "prefill_graph_tokens", "snapshot_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value < 2**31:
                raise ConfigError(f"EngineConfig.{name} must be an integer in 1..2^31-1, "
                                  f"got {value!r}")
        k = self.speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"EngineConfig.speculative_tokens must be an integer in "
                              f"0..{MAX_SPECULATIVE_TOKENS} (0: off), got {k!r}")
        if self.num_blocks is not None:
            if not isinstance(self.num_blocks, int) or not 1 <= self.num_blocks < 2**31:
                raise ConfigError(
                    f"EngineConfig.num_blocks must be an integer in 1..2^31-1 or None, "
                    f"got {self.num_blocks!r}"
                )
            if self.num_blocks * self.block_size < self.max_model_len:
                raise ConfigError(
                    f"EngineConfig: num_blocks * block_size = {self.num_blocks * self.block_size}"
                    f" tokens cannot hold one sequence of max_model_len = {self.max_model_len}"
                )
        if self.prefix_snapshots is not None and (
                not isinstance(self.prefix_snapshots, int) or isinstance(self.prefix_snapshots, bool)
                or not 1 <= self.prefix_snapshots < 2**31):
            raise ConfigError(f"EngineConfig.prefix_snapshots must be an integer in 1..2^31-1 or "
                              f"None, got {self.prefix_snapshots!r}")

    @property
    def snapshot_rows(self) -> int:
        """M/R snapshot rows the prefix cache keeps (0 with prefix caching off)."""
        if not self.prefix_cache:
            return 0
        return self.prefix_snapshots if self.prefix_snapshots is not None \
            else 2 * self.max_num_seqs

    @property
    def total_blocks(self) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        return default_num_blocks(self.max_num_seqs, self.max_model_len, self.block_size)


class QueueFull(MegaCppError):
    """The waiting queue holds ``max_waiting`` requests (HTTP 429)."""


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]  # tokens produced by this step for this request (may be empty)
    new_text: str  # text delta, stop-aware (never contains a stop string or text after it)
    finished: bool
    finish_reason: str | None  # "stop" | "eos" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    stop: str | None = None  # the stop string that ended it (finish_reason "stop")
    logprobs: list[TokenLogprob] | None = None  # of new_token_ids (SamplingParams.logprobs)
    # one per prompt token, the first None; on the request's first output only
    # (SamplingParams.prompt_logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class EngineStats:
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    free_slots: int
    total_slots: int
    preemptions: int  # cumulative
    prompt_tokens: int  # cumulative, counted once per request
    generated_tokens: int  # cumulative
    spec_draft_tokens: int = 0  # cumulative: MTP drafts verified (speculative decoding)
    spec_accepted_tokens: int = 0  # cumulative: drafts the main model accepted
    prefix_queried_tokens: int = 0  # cumulative: prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # cumulative: of those, tokens whose caches were reused
    prefix_cached_blocks: int = 0  # blocks indexed by the prefix cache (held or free)
    prefix_snapshots: int = 0  # M/R state snapshots held
    prefix_evicted_blocks: int = 0  # cumulative: cached blocks handed out again

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Reused / looked-up prompt tokens (0 before any lookup)."""
        return self.prefix_hit_tokens / self.prefix_queried_tokens \
            if self.prefix_queried_tokens else 0.0


class Engine:
    def __init__(
        self,
        model: HybridLM,
        tokenizer: CppTokenizer,
        config: EngineConfig,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.dtype = dtype if dtype is not None else next(model.parameters()).dtype
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.tokenizer, self.config = tokenizer, config
        if tokenizer.vocab_size > model.cfg.vocab_size:
            raise MegaCppError(
                f"tokenizer has {tokenizer.vocab_size} tokens, the model only "
                f"{model.cfg.vocab_size}"
            )
        self.cache = CacheManager(
            self.model,
            num_blocks=config.total_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            device=self.device,
            dtype=self.dtype,
            prefix_cache=config.prefix_cache,
            snapshots=config.snapshot_rows,
            snapshot_interval=config.snapshot_interval,
        )
        k = config.speculative_tokens
        self.speculative = (SpeculativeDecoder(self.model, self.cache, k, config.max_model_len,
                                               self.dtype) if k else None)
        self.scheduler = Scheduler(self.cache, config.max_num_seqs, config.prefill_chunk,
                                   lookahead=k, max_model_len=config.max_model_len)
        self.runner = ModelRunner(
            self.model,
            self.cache,
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            cuda_graphs=config.cuda_graphs,
            compile_decode=config.compile_decode,
            prefill_graphs=config.prefill_graphs,
            prefill_graph_tokens=config.prefill_graph_tokens,
        )
        if self.speculative is not None:
            self.runner.speculative, self.speculative.runner = self.speculative, self.runner
            if self.runner.graphs is not None:  # CUDA with cuda_graphs: the step is captured
                self.speculative.graphs = SpecGraphs(self.speculative, config.max_num_seqs,
                                                     self.runner.graphs.max_width)
        self.structure = (  # per-token structure ids, for a structure-embedding model
            StructureIds(tokenizer) if model.structure_embed is not None else None)
        self.sequences: dict[str, Sequence] = {}  # unfinished requests
        self._aborted: list[RequestOutput] = []  # reported by the next step()
        # request id -> prompt logprobs so far (requests with prompt_logprobs, until the
        # first output delivers them)
        self._prompt_logprobs: dict[str, list[TokenLogprob | None]] = {}
        self._prompt_tokens = self._generated_tokens = 0

    @property
    def graphs(self) -> DecodeGraphs | None:
        """The runner's captured decode graphs (None: eager decode)."""
        return self.runner.graphs

    @graphs.setter
    def graphs(self, graphs: DecodeGraphs | None) -> None:
        self.runner.graphs = graphs

    # -- requests --------------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> None:
        """Queue a request. ``str`` prompts get BOS prepended; ``list[int]`` is taken as is.
        Raises MegaCppError for an invalid request, QueueFull when the queue is full."""
        if not isinstance(request_id, str) or not request_id:
            raise MegaCppError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.sequences:
            raise MegaCppError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise MegaCppError(f"params must be SamplingParams, got {type(params).__name__}")
        prompt_ids = self._prompt_ids(prompt)
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise QueueFull(
                f"the waiting queue is full ({self.config.max_waiting} requests); retry later"
            )
        generator = None  # a CPU generator: one uniform draw per sampled token
        if params.temperature > 0:
            generator = torch.Generator()
            if params.seed is None:
                generator.seed()
            else:
                generator.manual_seed(params.seed % 2**64)  # any int seed is accepted
        seq = Sequence(
            request_id=request_id,
            prompt_len=len(prompt_ids),
            token_ids=prompt_ids,
            params=params,
            generator=generator,
            detok=IncrementalDetokenizer(self.tokenizer),
            stop_text=StopText(tuple(params.stop)),
            structure_ids=None if self.structure is None else self.structure.label(prompt_ids),
        )
        self.sequences[request_id] = seq
        if params.prompt_logprobs is not None:
            self._prompt_logprobs[request_id] = [None]  # nothing predicts the first token
        self.scheduler.add(seq)
        self._prompt_tokens += len(prompt_ids)

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = [self.tokenizer.bos_id, *self.tokenizer.encode(prompt).tolist()]
        elif isinstance(prompt, list | tuple):
            ids = list(prompt)
            vocab = self.model.cfg.vocab_size
            bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool)
                   or not 0 <= t < vocab]
            if bad:
                raise MegaCppError(
                    f"prompt token ids must be integers in [0, {vocab}), got {bad[:5]!r}"
                )
        else:
            raise MegaCppError(f"prompt must be a string or a list of token ids, got "
                               f"{type(prompt).__name__}")
        if not ids:
            raise MegaCppError("the prompt is empty")
        if len(ids) >= self.config.max_model_len:
            raise MegaCppError(
                f"the prompt has {len(ids)} tokens; max_model_len is "
                f"{self.config.max_model_len} (prompt + completion), so at most "
                f"{self.config.max_model_len - 1} prompt tokens are accepted"
            )
        return ids

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its blocks and slot; the next step() reports it
        finished with reason "abort". Unknown or already finished ids are ignored."""
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return
        self.scheduler.remove(seq)
        self._prompt_logprobs.pop(request_id, None)
        self._aborted.append(self._output(seq, [], "", "abort"))

    def has_unfinished(self) -> bool:
        return bool(self.sequences) or bool(self._aborted)

    def stats(self) -> EngineStats:
        prefix = self.cache.prefix
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            free_blocks=self.cache.blocks.num_free,
            total_blocks=self.cache.blocks.total,
            free_slots=self.cache.slots.num_free,
            total_slots=self.cache.slots.total,
            preemptions=self.scheduler.preemptions,
            prompt_tokens=self._prompt_tokens,
            generated_tokens=self._generated_tokens,
            spec_draft_tokens=0 if self.speculative is None else self.speculative.draft_tokens,
            spec_accepted_tokens=0 if self.speculative is None else self.speculative.accepted_tokens,
            **({} if prefix is None else {
                "prefix_queried_tokens": prefix.queried_tokens,
                "prefix_hit_tokens": prefix.hit_tokens,
                "prefix_cached_blocks": prefix.cached_blocks,
                "prefix_snapshots": prefix.snapshots,
                "prefix_evicted_blocks": prefix.blocks.evictions,
            }),
        )

    # -- one round -------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        """Schedule one round, run it, and apply its tokens; outputs for every request that
        produced a token, finished or was aborted."""
        outputs, self._aborted = self._aborted, []
        scheduled = self.scheduler.schedule()
        result = self.runner.execute(scheduled)
        return outputs + self.update_from_output(scheduled, result)

    def update_from_output(
        self, scheduled: SchedulerOutput, result: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """The scheduled tokens are in the caches now; append each sampled token and finish
        the requests that stop (their blocks and slot go back to the free lists)."""
        for work in (*scheduled.prefills, *scheduled.decodes):
            self.scheduler.computed(self.sequences[work.request_id], work.end)
        for rid, (first, entries) in result.prompt_logprobs.items():
            self._add_prompt_logprobs(self.sequences[rid], first, entries)
        outputs = []
        for rid, token in zip(result.request_ids, result.sampled_token_ids, strict=True):
            outputs.append(self._append_token(self.sequences[rid], token,
                                              result.logprobs.get(rid)))
        for rid, spec in result.speculative.items():
            outputs.append(self._append_speculated(self.sequences[rid], spec))
        if self.speculative is not None:
            self.speculative.forget(self.sequences)
        return outputs

    def _append_speculated(self, seq: Sequence, spec: SpecStep) -> RequestOutput:
        """A speculative step's tokens, one at a time until the request finishes (the tokens
        after that are dropped), as one output."""
        seq.num_computed = spec.num_computed
        ids, text = [], ""
        for token in spec.tokens:
            out = self._append_token(seq, token)
            ids.append(token)
            text += out.new_text
            if out.finished:
                break
        return dataclasses.replace(out, new_token_ids=ids, new_text=text)

    def _add_prompt_logprobs(self, seq: Sequence, first: int,
                             entries: list[TokenLogprob]) -> None:
        """Entries for tokens first, first+1, ...: keep the prompt tokens not yet recorded."""
        have = self._prompt_logprobs.get(seq.request_id)
        if have is None or len(have) >= seq.prompt_len:
            return  # delivered already, or complete (a recompute after preemption)
        if first > len(have):
            raise MegaCppError(
                f"request {seq.request_id!r}: prompt logprobs need every prompt position "
                f"computed, but prompt tokens {len(have)}..{first - 1} were not scored")
        have.extend(entries[len(have) - first : seq.prompt_len - first])

    def _append_token(self, seq: Sequence, token: int,
                      logprob: TokenLogprob | None = None) -> RequestOutput:
        seq.token_ids.append(token)
        self._generated_tokens += 1
        params = seq.params
        reason = None
        if token == self.tokenizer.eos_id and not params.ignore_eos:
            reason = "eos"
            text = ""
        else:
            text = seq.stop_text.add(seq.detok.add(token))
            if seq.stop_text.hit is not None:
                reason = "stop"
            elif (seq.completion_len >= params.max_new_tokens
                  or len(seq.token_ids) >= self.config.max_model_len):
                reason = "length"
        if reason in ("eos", "length"):
            text += seq.stop_text.add(seq.detok.flush()) + seq.stop_text.flush()
            if seq.stop_text.hit is not None:
                reason = "stop"
        if reason is not None:
            self.sequences.pop(seq.request_id, None)
            self.scheduler.remove(seq)
        elif self.structure is not None:  # the id the next decode step feeds with the token
            seq.structure_ids.append(self.structure.label_last(seq.token_ids))
        out = self._output(seq, [token], text, reason)
        if logprob is not None:
            out.logprobs = [logprob]
        if seq.request_id in self._prompt_logprobs:
            out.prompt_logprobs = self._prompt_logprobs.pop(seq.request_id)
            if len(out.prompt_logprobs) != seq.prompt_len:
                raise MegaCppError(f"request {seq.request_id!r}: {len(out.prompt_logprobs)} "
                                   f"prompt logprobs for {seq.prompt_len} prompt tokens")
        return out

    def _output(self, seq: Sequence, ids: list[int], text: str, reason: str | None) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=ids,
            new_text=text,
            finished=reason is not None,
            finish_reason=reason,
            prompt_tokens=seq.prompt_len,
            completion_tokens=seq.completion_len,
            stop=seq.stop_text.hit if reason == "stop" else None,
        )

