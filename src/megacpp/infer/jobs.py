"""From a request body to engine requests: the served :class:`Specialist`, and
:func:`prepare_job`, which routes the body to one, encodes its prompts, checks them against
the context and turns the sampling fields into :class:`SamplingParams`, one engine request
per prompt and choice."""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import Any

from megacpp.data.fim import FimIds, psm_prompt
from megacpp.errors import MegaCppError
from megacpp.infer.async_engine import AsyncEngine
from megacpp.infer.chat_template import CHAT_STOP, message_text, render_chat
from megacpp.infer.protocol import (
    DEFAULT_COMPLETION_TOKENS,
    BadRequest,
    Body,
    ChatRequest,
    CompletionRequest,
    refuse_unsupported,
    stop_strings,
)
from megacpp.infer.router import Route, Router
from megacpp.infer.sampling import SamplingParams, sample_seed

SPECIALIST_HEADER = "x-megacpp-specialist"
ROUTE_HEADER = "x-megacpp-route"


@dataclass
class Specialist:
    """One served model: its engine (wrapped), tokenizer and context length."""

    name: str
    engine: AsyncEngine
    tokenizer: Any  # CppTokenizer
    max_model_len: int
    checkpoint: str | None = None
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


@dataclass
class Job:
    """One accepted request: what was asked and where it went."""

    endpoint: str  # "completions" | "chat"
    body: Body
    specialist: Specialist
    route: Route
    request_id: str
    prompts: list[list[int]]
    index: dict[str, int]  # engine request id -> choice index
    arrived: float

    def headers(self) -> dict[str, str]:
        return {SPECIALIST_HEADER: self.specialist.name, ROUTE_HEADER: self.route.how}

    @property
    def generates(self) -> bool:
        """False for a completion with echo and max_tokens=0: the engine samples one token
        (its prefill yields one anyway), which the response leaves out."""
        return self.body.max_tokens != 0

    @property
    def echo(self) -> bool:
        return isinstance(self.body, CompletionRequest) and self.body.echo


def prepare_job(endpoint: str, body: Body, arrived: float, specialists: dict[str, Specialist],
                router: Router) -> tuple[Job, list]:
    """Route, encode and validate; returns the job and the engine requests."""
    refuse_unsupported(body)
    stops = stop_strings(body)
    if isinstance(body, ChatRequest):
        texts = [message_text(m, i) for i, m in enumerate(body.messages)]
        route = router.route(body.model, "\n".join(texts))
        spec = specialists[route.name]
        prompts = [_encode(spec, render_chat(body.messages))]
        stops = (*stops, CHAT_STOP)
    else:
        route = router.route(body.model, _prompt_text(body, specialists))
        spec = specialists[route.name]
        prompts = _completion_prompts(spec, body)
    limit = spec.engine.engine.config.max_waiting
    if len(prompts) * body.n > limit:
        raise BadRequest(f"this request asks for {len(prompts) * body.n} sequences (prompts x "
                         f"n); the server queues at most {limit}", "n")
    prefix = "chatcmpl" if endpoint == "chat" else "cmpl"
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    requests, index = [], {}
    for p, ids in enumerate(prompts):
        max_tokens = _max_tokens(spec, body, len(ids))
        for j in range(body.n):
            choice = p * body.n + j
            rid = f"{request_id}-{choice}"
            index[rid] = choice
            requests.append((rid, ids, _params(body, max_tokens, stops, j)))
    return Job(endpoint, body, spec, route, request_id, prompts, index, arrived), requests


def _prompt_text(body: CompletionRequest, specialists: dict[str, Specialist]) -> str:
    """The text the router classifies: the prompt, or its token ids decoded."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return prompt
    if prompt and isinstance(prompt[0], str):
        return "\n".join(prompt)
    spec = next(iter(specialists.values()))
    rows = [prompt] if prompt and isinstance(prompt[0], int) else prompt
    return "\n".join(spec.tokenizer.decode(r) for r in rows if r and all(
        isinstance(t, int) and 0 <= t < spec.tokenizer.vocab_size for t in r))


def _encode(spec: Specialist, text: str) -> list[int]:
    return [spec.tokenizer.bos_id, *spec.tokenizer.encode(text).tolist()]


def _completion_prompts(spec: Specialist, body: CompletionRequest) -> list[list[int]]:
    if body.suffix is not None:
        return _fim_prompts(spec, body)
    prompt = body.prompt
    if isinstance(prompt, str):
        return [_encode(spec, prompt)]
    if not prompt:
        raise BadRequest("prompt must not be empty", "prompt")
    if isinstance(prompt[0], str):
        return [_encode(spec, p) for p in prompt]
    rows = [prompt] if isinstance(prompt[0], int) else prompt
    vocab = spec.tokenizer.vocab_size
    for row in rows:
        if not row:
            raise BadRequest("prompt token lists must not be empty", "prompt")
        bad = [t for t in row if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}",
                             "prompt")
    return [list(r) for r in rows]


def _fim_prompts(spec: Specialist, body: CompletionRequest) -> list[list[int]]:
    """Fill in the middle: each text prompt is the prefix and ``suffix`` the text after the
    cursor; the prompt is ``BOS <|fim_prefix|> prompt <|fim_suffix|> suffix <|fim_middle|>``
    (PSM, as the data build's ``[fim]`` trains it), and the completion, which ends at EOS,
    is the middle."""
    prompt = body.prompt
    texts = [prompt] if isinstance(prompt, str) else prompt
    if not texts or not all(isinstance(t, str) for t in texts):
        raise BadRequest("suffix needs a text prompt (a string or a list of strings), not "
                         "token ids", "suffix")
    try:
        fim = FimIds.of(spec.tokenizer)
    except MegaCppError as exc:
        raise BadRequest(f"suffix is not supported by model {spec.name!r}: {exc}",
                         "suffix") from None
    tok = spec.tokenizer
    suffix_ids = tok.encode(body.suffix).tolist()
    return [[tok.bos_id, *psm_prompt(tok.encode(t).tolist(), suffix_ids, fim)] for t in texts]


def _max_tokens(spec: Specialist, body: Body, prompt_len: int) -> int:
    room = spec.max_model_len - prompt_len
    if room < 1:
        raise BadRequest(f"the prompt has {prompt_len} tokens; this model's context is "
                         f"{spec.max_model_len} tokens, which leaves no room to generate",
                         "prompt")
    asked = body.max_tokens
    if asked == 0:  # echo only (refuse_unenforceable): one token is sampled and left out
        return 1
    if isinstance(body, ChatRequest):
        asked = body.max_completion_tokens or asked
    if asked is None:
        return room if isinstance(body, ChatRequest) else min(room, DEFAULT_COMPLETION_TOKENS)
    if prompt_len + asked > spec.max_model_len:
        raise BadRequest(f"the prompt ({prompt_len} tokens) plus max_tokens ({asked}) is "
                         f"more than this model's context of {spec.max_model_len} tokens",
                         "max_tokens")
    return asked


def _params(body: Body, max_tokens: int, stops: tuple[str, ...], j: int) -> SamplingParams:
    if isinstance(body, ChatRequest):
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        prompt_logprobs = None
    else:
        logprobs = body.logprobs
        prompt_logprobs = body.logprobs if body.echo else None
    return SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_k=body.top_k or 0,
        top_p=1.0 if body.top_p is None else body.top_p,
        max_new_tokens=max_tokens,
        stop=stops,
        seed=sample_seed(body.seed, j),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )
