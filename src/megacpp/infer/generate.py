"""Text generation for the CLI, the evaluator and the Python API, through the serving engine.

:class:`TextGenerator` runs every completion it is asked for as a request of one
:class:`~megacpp.infer.engine.Engine` (paged caches, continuous batching, CUDA graphs on a
GPU): the same decode path as ``megacpp serve``. The engine is sized to the work -- as many
rows as there are completions, up to ``max_num_seqs`` decoded together, and room for the
longest prompt plus ``max_new_tokens`` -- and its cache is checked against the device's
memory before anything is allocated.

Sampling is per completion: sample ``j`` of a prompt draws from its own generator, seeded with
``seed + j`` (as the server seeds the ``n`` samples of one request), so a seeded run repeats
exactly and a completion's random draws do not depend on what it was batched with. Greedy is
argmax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megacpp.data.fim import FimIds, psm_prompt
from megacpp.data.tokenizer import CppTokenizer
from megacpp.errors import MegaCppError
from megacpp.infer.batch import (
    CPP_BODY_STOP,
    BatchRequest,
    BatchResult,
    close_function_body,
    run_batch,
)
from megacpp.infer.cache_manager import pool_bytes
from megacpp.infer.engine import Engine, EngineConfig
from megacpp.infer.memory import check_fits
from megacpp.infer.sampling import SamplingParams, sample_seed
from megacpp.infer.speculative import check_speculative
from megacpp.model.model import HybridLM

__all__ = ["CPP_BODY_STOP", "MAX_COMPLETIONS", "Completion", "FunctionBodyGenerator",
           "TextGenerator", "close_function_body", "generate"]

MAX_COMPLETIONS = 1 << 16  # completions of one prompt at most
MAX_NUM_SEQS = 64  # completions decoded together at most (the engine's batch)
BLOCK_SIZE = 16  # tokens per KV block
MAX_MODEL_LEN = 2**31 - 1  # prompt + completion tokens (an int32 position)


@dataclass
class Completion:
    text: str
    token_ids: list[int]  # the sampled tokens (an ending EOS left off)
    finish_reason: str  # "stop" | "eos" | "length"
    stop: str | None = None  # the stop sequence that ended it


class TextGenerator:
    """Generates text from a model and its tokenizer on ``device`` (default: the model's);
    prompts begin with BOS."""

    def __init__(self, model: HybridLM, tokenizer: CppTokenizer,
                 device: str | torch.device | None = None,
                 max_num_seqs: int = MAX_NUM_SEQS, speculative_tokens: int = 0) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = torch.device(device) if device is not None else _device_of(model)
        self.dtype = next(model.parameters()).dtype
        self.max_num_seqs = max_num_seqs
        self.speculative_tokens = speculative_tokens  # MTP drafts per greedy step (0: off)
        if speculative_tokens:  # refused before any prompt is read
            EngineConfig(speculative_tokens=speculative_tokens)
            check_speculative(model, speculative_tokens)

    def complete(self, prompt: str, n: int, params: SamplingParams) -> list[Completion]:
        """``n`` completions of ``prompt``."""
        return self.complete_all([prompt], n, params)[0]

    def complete_all(self, prompts: list[str], n: int,
                     params: SamplingParams) -> list[list[Completion]]:
        """``n`` completions of every prompt (prompt order, then sample order), all through
        one engine run."""
        if not 1 <= n <= MAX_COMPLETIONS:
            raise MegaCppError(f"n = {n}: expected 1..{MAX_COMPLETIONS} completions")
        if not prompts:
            return []
        prompt_ids = [[self.tokenizer.bos_id, *self.tokenizer.encode(p).tolist()] for p in prompts]
        return self._run(prompt_ids, n, params)

    def infill_all(self, pairs: list[tuple[str, str]], params: SamplingParams,
                   on_finish: Callable[[int, Completion], None] | None = None,
                   ) -> list[Completion]:
        """The middle of each (prefix, suffix) pair: one completion of the fill-in-the-middle
        prompt ``BOS <|fim_prefix|> prefix <|fim_suffix|> suffix <|fim_middle|>``, which ends
        at EOS (the prompt ``megacpp serve`` makes for a ``suffix``). All pairs go through
        one engine run; ``on_finish(i, completion)`` is called as pair ``i`` finishes."""
        if not pairs:
            return []
        fim, tok = FimIds.of(self.tokenizer), self.tokenizer
        prompt_ids = [[tok.bos_id, *psm_prompt(tok.encode(prefix).tolist(),
                                               tok.encode(suffix).tolist(), fim)]
                      for prefix, suffix in pairs]
        finished = None if on_finish is None else (
            lambda rid, result: on_finish(int(rid.split("/")[0]), self._completion(result)))
        return [row[0] for row in self._run(prompt_ids, 1, params, finished)]

    def _run(self, prompt_ids: list[list[int]], n: int, params: SamplingParams,
             on_finish: Callable[[str, BatchResult], None] | None = None,
             ) -> list[list[Completion]]:
        engine = self._engine(max(map(len, prompt_ids)), n * len(prompt_ids), params.max_new_tokens)
        requests = [
            BatchRequest(f"{i}/{j}", ids, dataclasses.replace(params, seed=sample_seed(params.seed, j)))
            for i, ids in enumerate(prompt_ids) for j in range(n)
        ]
        results = run_batch(engine, requests, on_finish)
        return [[self._completion(results[f"{i}/{j}"]) for j in range(n)]
                for i in range(len(prompt_ids))]

    def _engine(self, longest_prompt: int, completions: int, max_new_tokens: int) -> Engine:
        """An engine for ``completions`` requests of prompts up to ``longest_prompt`` tokens,
        refused with one line when its cache cannot fit the device."""
        rows = min(completions, self.max_num_seqs)
        max_model_len = min(longest_prompt + max_new_tokens, MAX_MODEL_LEN)
        has_attention = any(layout is not None for layout in self.model.paged_layouts())
        # without attention layers the blocks hold nothing: one per row
        block_size = BLOCK_SIZE if has_attention else max_model_len
        num_blocks = rows * -(-max_model_len // block_size)
        need = pool_bytes(self.model, num_blocks, block_size, rows, self.dtype)
        check_fits(need, self.device, f"the cache of {completions} completion(s) of up to "
                   f"{max_new_tokens} new tokens ({rows} decoded together)",
                   "ask for fewer tokens or completions")
        config = EngineConfig(max_num_seqs=rows, block_size=block_size, num_blocks=num_blocks,
                              max_model_len=max_model_len,
                              speculative_tokens=self.speculative_tokens)
        return Engine(self.model, self.tokenizer, config, self.device, self.dtype)

    def _completion(self, result: BatchResult) -> Completion:
        ids = result.token_ids[:-1] if result.finish_reason == "eos" else result.token_ids
        return Completion(result.text, ids, result.finish_reason, result.stop)

    def __call__(self, prompts: list[str], n: int, temperature: float, **options: Any) -> list[list[str]]:
        """The evaluator's generator protocol: ``n`` completion strings per prompt."""
        params = SamplingParams(temperature=temperature, **options)
        return [[c.text for c in row] for row in self.complete_all(prompts, n, params)]


def generate(
    model: HybridLM, tokenizer: CppTokenizer, prompt: str, max_new_tokens: int = 128,
    temperature: float = 0.8, top_p: float = 0.95, top_k: int = 0, seed: int | None = None,
    stop: tuple[str, ...] = (),
) -> str:
    """One sampled completion of ``prompt`` (the text after it), on the model's device.

    ``temperature = 0`` is greedy; ``top_p = 1`` and ``top_k = 0`` turn those filters off;
    the same ``seed`` gives the same text. Generation ends at EOS, at a ``stop`` string (not
    included) or after ``max_new_tokens``.
    """
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                            max_new_tokens=max_new_tokens, stop=tuple(stop), seed=seed)
    (completion,) = TextGenerator(model, tokenizer).complete(prompt, 1, params)
    return completion.text


def _device_of(model: HybridLM) -> torch.device:
    return next(model.parameters()).device


class FunctionBodyGenerator:
    """Completes C++ function bodies (prompt ends inside the function): stops at the closing
    brace in column 0 and puts that brace back, so prompt + completion is a whole function.
    Every prompt's samples run through one engine run."""

    def __init__(self, generator: TextGenerator, max_new_tokens: int = 384) -> None:
        self.generator = generator
        self.max_new_tokens = max_new_tokens

    def __call__(self, prompts: list[str], n: int, temperature: float, **options: Any) -> list[list[str]]:
        options.setdefault("max_new_tokens", self.max_new_tokens)
        params = SamplingParams(temperature=temperature, stop=(CPP_BODY_STOP,), **options)
        return [[close_function_body(c.text, c.finish_reason) for c in row]
                for row in self.generator.complete_all(prompts, n, params)]
