"""Batched text generation over the model's per-layer caches.

``n`` samples of one prompt share one batch: the prompt is prefilled once per row and every
decode step advances all rows. Rows that finished keep being computed (their outputs are
ignored) until all are done -- simple, and exact for the batch sizes eval and CLI use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megacpp.data.tokenizer import CppTokenizer
from megacpp.errors import MegaCppError
from megacpp.infer.memory import check_fits
from megacpp.infer.sampling import SamplingParams, sample_next_token
from megacpp.model.model import HybridLM

MAX_COMPLETIONS = 1 << 16  # completions of one prompt at most


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "eos" | "length"
    stop: str | None = None  # the stop sequence that ended it


class TextGenerator:
    """Generates text from a model and its tokenizer; prompts begin with BOS."""

    def __init__(self, model: HybridLM, tokenizer: CppTokenizer, device: str | torch.device = "cpu"):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.dtype = next(model.parameters()).dtype

    @torch.no_grad()
    def complete(self, prompt: str, n: int, params: SamplingParams) -> list[Completion]:
        """``n`` sampled completions of ``prompt``."""
        prompt_ids = [self.tokenizer.bos_id, *self.tokenizer.encode(prompt).tolist()]
        generator = torch.Generator(device=self.device)
        if params.seed is None:
            generator.seed()  # non-deterministic, and leaves the global RNG alone
        else:
            generator.manual_seed(params.seed)
        if not 1 <= n <= MAX_COMPLETIONS:
            raise MegaCppError(f"n = {n}: expected 1..{MAX_COMPLETIONS} completions")
        capacity = len(prompt_ids) + params.max_new_tokens
        self._check_cache_fits(n, capacity, params.max_new_tokens)
        ids = torch.tensor([prompt_ids] * n, device=self.device)
        cache = self.model.init_cache(n, capacity, self.device, self.dtype)
        logits = self.model.prefill(ids, cache)[:, -1]
        rows: list[list[int]] = [[] for _ in range(n)]
        results: list[Completion | None] = [None] * n
        for step in range(params.max_new_tokens):
            tokens = sample_next_token(logits, params, generator)
            for i, token in enumerate(tokens.tolist()):
                if results[i] is None:
                    rows[i].append(token)
                    results[i] = self._finished(rows[i], params, last=step == params.max_new_tokens - 1)
            if all(r is not None for r in results):
                break
            logits = self.model.decode_step(tokens, cache)
        return [r for r in results if r is not None]

    def _check_cache_fits(self, n: int, capacity: int, max_new_tokens: int) -> None:
        """Refuse a cache larger than the memory available on the device (sized on the meta
        device, so nothing is allocated to find out)."""
        need = self.model.init_cache(n, capacity, "meta", self.dtype).nbytes()
        check_fits(need, self.device, f"the cache of {n} completion(s) of up to "
                   f"{max_new_tokens} new tokens", "ask for fewer tokens or completions")

    def _finished(self, row: list[int], params: SamplingParams, last: bool) -> Completion | None:
        if row[-1] == self.tokenizer.eos_id:
            return Completion(self.tokenizer.decode(row[:-1]), row[:-1], "eos")
        if params.stop:
            text = self.tokenizer.decode(row)
            hits = [(text.find(s), s) for s in params.stop if s in text]
            if hits:
                cut, stop = min(hits)
                return Completion(text[:cut], row, "stop", stop)
        if last:
            return Completion(self.tokenizer.decode(row), row, "length")
        return None

    def __call__(self, prompts: list[str], n: int, temperature: float, **options: Any) -> list[list[str]]:
        """The evaluator's generator protocol: ``n`` completion strings per prompt."""
        params = SamplingParams(temperature=temperature, **options)
        return [[c.text for c in self.complete(p, n, params)] for p in prompts]


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
    device = next(model.parameters()).device
    (completion,) = TextGenerator(model, tokenizer, device).complete(prompt, 1, params)
    return completion.text


CPP_BODY_STOP = "\n}"  # a closing brace in column 0 ends the function being completed


def close_function_body(text: str, finish_reason: str) -> str:
    """A function-body completion stopped at :data:`CPP_BODY_STOP` with that brace put back,
    so prompt + completion is the whole function; any other ending is left as it is."""
    return text + CPP_BODY_STOP + "\n" if finish_reason == "stop" else text


class FunctionBodyGenerator:
    """Completes C++ function bodies (prompt ends inside the function): stops at the closing
    brace in column 0 and puts that brace back, so prompt + completion is a whole function."""

    def __init__(self, generator: TextGenerator, max_new_tokens: int = 384) -> None:
        self.generator = generator
        self.max_new_tokens = max_new_tokens

    def __call__(self, prompts: list[str], n: int, temperature: float, **options: Any) -> list[list[str]]:
        options.setdefault("max_new_tokens", self.max_new_tokens)
        params = SamplingParams(temperature=temperature, stop=(CPP_BODY_STOP,), **options)
        out = []
        for prompt in prompts:
            completions = self.generator.complete(prompt, n, params)
            out.append([close_function_body(c.text, c.finish_reason) for c in completions])
        return out
