"""Next-token sampling: temperature, top-k, top-p (nucleus), seeded."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megacpp.errors import MegaCppError

MAX_NEW_TOKENS = 2**31 - 1  # an int32 position; the cache memory is checked where it is made
MAX_LOGPROBS = 20  # top alternatives per token at most (vLLM's default cap, OpenAI chat's)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` is greedy decoding. ``top_k == 0`` and ``top_p == 1`` disable those
    filters. ``stop`` strings end a completion and are not part of it (OpenAI semantics).
    ``ignore_eos`` keeps generating past EOS until ``max_new_tokens`` (for benchmarks).
    ``logprobs = k`` returns each sampled token's log-probability and the ``k`` most likely
    tokens at its position; ``prompt_logprobs = k`` the same for every prompt token after the
    first (:mod:`megacpp.infer.logprobs`). None turns either off.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise MegaCppError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise MegaCppError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise MegaCppError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise MegaCppError(f"max_new_tokens must be in 1..{MAX_NEW_TOKENS}, got "
                               f"{self.max_new_tokens}")
        seed_ok = isinstance(self.seed, int) and not isinstance(self.seed, bool) and (
            -(2**63) <= self.seed < 2**64)
        if self.seed is not None and not seed_ok:
            raise MegaCppError(f"seed must be a 64-bit integer or None, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise MegaCppError(f"stop sequences must be non-empty strings, got {self.stop!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or isinstance(k, bool)
                                  or not 0 <= k <= MAX_LOGPROBS):
                raise MegaCppError(f"{name} must be None or an integer in 0..{MAX_LOGPROBS}, "
                                   f"got {k!r}")


def sample_seed(seed: int | None, j: int) -> int | None:
    """The seed of sample ``j`` of a request seeded ``seed``: ``seed + j`` (wrapped to 64 bits,
    the same generator state), None when unseeded; the server, the CLI and the evaluator
    seed the ``n`` samples of a prompt this way."""
    return None if seed is None else (seed + j) % 2**64


def _scaled(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """(logits - each row's max) / temperature, in float32. Shifting first keeps a tiny
    temperature finite: the best tokens stay at 0 (not 0/0 when the temperature rounds to 0
    in float32) and the others go to -inf, the limit of sampling as the temperature falls."""
    shifted = logits.float() - logits.float().amax(-1, keepdim=True)
    return torch.where(shifted == 0, 0.0, shifted / temperature)


def sample_next_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    """logits [B, V] -> token ids [B]."""
    if params.temperature == 0:
        return logits.argmax(-1)
    scores = _scaled(logits, params.temperature)
    if params.top_k:
        kth = torch.topk(scores, min(params.top_k, scores.shape[-1]), dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if params.top_p < 1:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        probs = sorted_scores.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p (keeps >= 1 token)
        drop_sorted = probs.cumsum(-1) - probs >= params.top_p
        drop_sorted[:, 0] = False  # a top_p below float32's range would drop them all
        scores = scores.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), -math.inf)
    probs = scores.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniform: torch.Tensor,
) -> torch.Tensor:
    """One token per row, each row with its own parameters, in one batched pass (no host
    sync, no per-row kernels) -- the serving engine's sampler.

    Args:
        logits: [B, V].
        temperature: [B] float; rows with 0 are greedy (argmax).
        top_k: [B] int64; 0 disables. top_p: [B] float in (0, 1].
        uniform: [B] float in [0, 1): each row's random draw (from the request's own
            generator, so a request's samples do not depend on what it is batched with).
    Returns:
        [B] int64 token ids. The same filters as :func:`sample_next_token` (top-k first, then
        top-p over the renormalised rest), sampled by inverse CDF over the sorted tokens.
    """
    V = logits.shape[-1]
    greedy = temperature <= 0
    scores = _scaled(logits, torch.where(greedy, 1.0, temperature.float())[:, None])
    sorted_scores, order = scores.sort(dim=-1, descending=True)  # [B, V]
    rank = torch.arange(V, device=logits.device)
    k = torch.where(top_k > 0, top_k, V)[:, None]
    sorted_scores = sorted_scores.masked_fill(rank >= k, -math.inf)
    probs = sorted_scores.softmax(-1)
    drop = probs.cumsum(-1) - probs >= top_p.float()[:, None]  # the tokens above reach top_p
    drop[:, 0] = False  # the best token stays, even for a top_p that rounds to 0 in float32
    probs = probs.masked_fill(drop, 0.0)
    cdf = probs.cumsum(-1)  # [B, V]
    target = uniform.float()[:, None] * cdf[:, -1:]
    pick = torch.searchsorted(cdf, target, right=True).clamp(max=V - 1)  # [B, 1]
    sampled = order.gather(-1, pick).squeeze(-1)
    return torch.where(greedy, logits.argmax(-1), sampled)
