"""Token log-probabilities: computed from the model's logits, and written in the OpenAI wire
formats.

A logprob here is ``log_softmax`` of the model's logits at temperature 1, before temperature,
top-k and top-p (vLLM's default, "raw" logprobs): the distribution the model assigns, not the
filtered one a sampled token was drawn from. So a token's logprob does not depend on the
request's sampling settings, and a prompt token's logprob (``echo``) and a generated token's
are the same quantity. ``-inf`` (a token the model rules out) is written as ``-9999.0``, as
vLLM does, because JSON has no infinity.

Two formats: the legacy completions object (``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``; :class:`CompletionLogprobs`), where ``top_logprobs`` maps
the ``k`` most likely tokens *and* the chosen token to their logprobs (up to ``k + 1``
entries, as OpenAI documents); and the chat object (``{"content": [{"token", "logprob",
"bytes", "top_logprobs"}]}``; :func:`chat_logprobs`), whose ``top_logprobs`` lists exactly
the ``k`` most likely tokens.

A token's string is its bytes decoded as UTF-8; a token whose bytes are not whole UTF-8
characters (part of a multi-byte character) is written ``bytes:\\xe2\\x80`` as OpenAI does, so
distinct tokens keep distinct strings (the chat format's ``bytes`` hold them exactly); a
special token shows its name (``<|eos|>``). ``text_offset`` is where the token's text starts in the returned text: the
characters the incremental detokenizer had released before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megacpp.infer.detokenize import IncrementalDetokenizer, token_bytes

LOGPROB_FLOOR = -9999.0  # what -inf is written as (JSON has no infinity)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token at one position: its logprob and the position's most likely tokens."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token, logprob) of the k most likely, best first


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> list[TokenLogprob]:
    """logits [N, V] and the token taken at each of the N positions [N] -> N entries, each
    with the ``k`` most likely tokens. Host transfers per batch (the chosen logprobs, the
    tokens, the top ids and logprobs), none per row."""
    logp = torch.log_softmax(logits.float(), dim=-1).clamp(min=LOGPROB_FLOOR)  # [N, V]
    chosen = logp.gather(-1, tokens[:, None].long()).squeeze(-1)  # [N]
    k = min(k, logp.shape[-1])
    if k:
        top_logp, top_ids = logp.topk(k, dim=-1)  # [N, k]
        top_logp_l, top_ids_l = top_logp.tolist(), top_ids.tolist()
    else:
        top_logp_l = top_ids_l = [[] for _ in range(logp.shape[0])]
    chosen_l, tokens_l = chosen.tolist(), tokens.tolist()
    return [TokenLogprob(int(t), lp, tuple(zip(ids, lps, strict=True)))
            for t, lp, ids, lps in zip(tokens_l, chosen_l, top_ids_l, top_logp_l, strict=True)]


def truncated(entry: TokenLogprob, k: int) -> TokenLogprob:
    """``entry`` with only its ``k`` most likely alternatives."""
    return entry if len(entry.top) <= k else TokenLogprob(entry.token, entry.logprob,
                                                           entry.top[:k])


# ---- the wire formats ------------------------------------------------------------------------


class _TokenText:
    """A tokenizer's token strings and bytes (specials by name)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.table = token_bytes(tokenizer)

    def bytes(self, token: int) -> bytes:
        piece = self.table[token] if 0 <= token < len(self.table) else b""
        return piece or self.text(token).encode("utf-8")

    def text(self, token: int) -> str:
        piece = self.table[token] if 0 <= token < len(self.table) else b""
        if not piece:
            return self.tokenizer.hf.id_to_token(token) or ""
        try:
            return piece.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


class CompletionLogprobs:
    """The legacy completions ``logprobs`` object of one choice, built a piece at a time
    (one piece per streamed chunk, or the whole choice at once); offsets continue across
    pieces. With ``echo``, the prompt is the first piece and its first token has no logprob
    (``null``), as in OpenAI's API."""

    def __init__(self, tokenizer: Any) -> None:
        self._text = _TokenText(tokenizer)
        self._detok = IncrementalDetokenizer(tokenizer)
        self._offset = 0

    def piece(self, token_ids: list[int], entries: list[TokenLogprob | None]) -> dict:
        """The object for ``token_ids`` (``entries[i]`` is None: no logprob for that token)."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}
        for token, entry in zip(token_ids, entries, strict=True):
            out["tokens"].append(self._text.text(token))
            out["text_offset"].append(self._offset)
            self._offset += len(self._detok.add(token))
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            top: dict[str, float] = {}
            for t, lp in entry.top:  # best first: a repeated string keeps its best logprob
                top.setdefault(self._text.text(t), lp)
            top.setdefault(self._text.text(token), entry.logprob)  # the chosen token, always
            out["token_logprobs"].append(entry.logprob)
            out["top_logprobs"].append(top)
        return out


def merge_pieces(pieces: list[dict]) -> dict:
    """Several :meth:`CompletionLogprobs.piece` objects of one choice as one."""
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {key: [v for p in pieces for v in p[key]] for key in keys}


def chat_logprobs(tokenizer: Any, entries: list[TokenLogprob]) -> dict:
    """The chat ``logprobs`` object (``{"content": [...]}``) of these tokens."""
    text = _TokenText(tokenizer)

    def item(token: int, logprob: float) -> dict:
        return {"token": text.text(token), "logprob": logprob, "bytes": list(text.bytes(token))}

    return {"content": [{**item(e.token, e.logprob),
                         "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]}
