"""The OpenAI-compatible HTTP server: FastAPI over one :class:`AsyncEngine` per specialist.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true``
answers Server-Sent Events: one ``data: {json}\\n\\n`` chunk per engine output that carries
text, then ``data: [DONE]``; otherwise one JSON body), ``GET /v1/models``, ``GET /health``
and ``GET /metrics`` (Prometheus text format).

Errors are OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``): an invalid
body is 400 (FastAPI's default 422 is turned into 400), an unknown ``model`` 404, a full
waiting queue 429, a stopped engine 503, an engine failure 500.

Sampling fields: ``max_tokens`` (chat: also ``max_completion_tokens``), ``temperature``,
``top_p``, ``n``, ``stop`` (a string or up to 16 strings), ``seed``, ``stream``,
``stream_options.include_usage``, plus the extensions ``top_k`` and ``ignore_eos``. Fields
this server cannot honour (``logprobs``, ``echo``, ``suffix``, penalties, ``logit_bias``,
``best_of`` > 1, tools) are refused with 400 unless they are at their neutral value;
other unknown fields are ignored. A string prompt is encoded with BOS first; a prompt of
token ids is used as is. ``max_tokens`` defaults to 16 for completions (as OpenAI) and to
the rest of the context for chat.

Chat template (for a base C++ code model, which has never seen chat turns): the
conversation becomes a C++ file in which instructions are comments and answers are code::

    // system: <first line of the system message>
    // <each further line>
    // user: <first line of the user message>
    // <each further line>
    <an assistant message, verbatim, followed by a newline>

System, developer and user messages render as ``//`` comment lines introduced by their
role; assistant messages are code. The completion is the code that follows the last
message, and ``"\\n// user:"`` is always a stop sequence, so the model cannot write the
next user turn. If the last message is the assistant's, the completion continues it (no
newline is added). Routing (``model: "auto"``) classifies the messages' raw text, since the
C++ lexer drops comments.

The chosen specialist is the response's ``model`` field and its ``x-megacpp-specialist``
header; ``x-megacpp-route`` says how it was chosen (``model``, ``auto`` or ``default``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from megacpp.errors import MegaCppError
from megacpp.infer.async_engine import AsyncEngine, EngineFailure, EngineStopped, RequestStream
from megacpp.infer.router import AUTO, Route, Router, SnippetClassifier, UnknownModel
from megacpp.infer.sampling import SamplingParams

log = logging.getLogger("megacpp.serve")

CHAT_STOP = "\n// user:"
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
MAX_STOP_SEQUENCES = 16
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}
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


# ---- request bodies -------------------------------------------------------------------------


def _lone_surrogate(value: Any, where: str) -> str | None:
    """Where in ``value`` (nested lists and dicts) a string holds a lone UTF-16 surrogate --
    JSON's ``"\\ud800"`` decodes to one, and it is not text that can be encoded -- or None."""
    stack = [(value, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return path
        elif isinstance(item, dict):
            stack.extend((k, f"{path} (a key)") for k in item)
            stack.extend((v, f"{path}.{k}") for k, v in item.items())
        elif isinstance(item, (list, tuple)):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(item))
    return None


class _Strict(BaseModel):
    """Strict types (``"5"`` is not a number), unknown fields ignored, and every string valid
    Unicode text."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="after")
    def _text_only(self) -> Any:
        for name in type(self).model_fields:
            where = _lone_surrogate(getattr(self, name), name)
            if where is not None:
                raise ValueError(f"{where} holds a lone UTF-16 surrogate (such as \\ud800), "
                                 "which is not text")
        return self


class _Body(_Strict):
    """Fields shared by both endpoints."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # extension
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: dict[str, bool] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False  # extension: generate past EOS (benchmarks)
    # accepted only at their neutral value
    logprobs: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    best_of: int | None = None


class CompletionRequest(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]]  # required: this server has no tool calls


class ChatRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Any] | None = None


class BadRequest(MegaCppError):
    """An invalid request (HTTP 400); ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _refuse_unsupported(body: _Body) -> None:
    neutral = {"logprobs": (None, False, 0), "presence_penalty": (None, 0), "frequency_penalty":
               (None, 0), "logit_bias": (None, {}), "best_of": (None, 1), "echo": (False,),
               "suffix": (None, ""), "tools": (None, [])}
    for name, allowed in neutral.items():
        if name not in type(body).model_fields:
            continue
        value = getattr(body, name)
        if value not in allowed:
            raise BadRequest(f"{name}={value!r} is not supported by this server", name)


def _stops(body: _Body) -> tuple[str, ...]:
    stop = body.stop
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOP_SEQUENCES or any(not s for s in stops):
        raise BadRequest(f"stop must be up to {MAX_STOP_SEQUENCES} non-empty strings", "stop")
    return stops


# ---- chat template --------------------------------------------------------------------------


def _message_text(message: ChatMessage, index: int) -> str:
    content = message.content
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise BadRequest(f"messages[{index}].content: only text parts are supported",
                             f"messages[{index}].content")
        parts.append(part["text"])
    return "".join(parts)


def render_chat(messages: Sequence[ChatMessage]) -> str:
    """The prompt text of a conversation (see the module docstring)."""
    out = []
    for i, message in enumerate(messages):
        text = _message_text(message, i)
        last = i == len(messages) - 1
        if message.role == "assistant":
            out.append(text if last else text + "\n")
            continue
        lines = text.split("\n")
        out.append(f"// {message.role}: {lines[0]}".rstrip() + "\n")
        out.extend(f"// {line}".rstrip() + "\n" for line in lines[1:])
    return "".join(out)


# ---- metrics --------------------------------------------------------------------------------

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Histogram:
    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.sum += value
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                return
        self.counts[-1] += 1


def _labels(**labels: str) -> str:
    def esc(v: str) -> str:
        return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in labels.items()) + "}" if labels else ""


class Metrics:
    """Counters and histograms of the server; rendered with the engines' live stats."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, str], int] = {}  # (endpoint, model, code) -> n
        self.prompt_tokens: dict[str, int] = {}
        self.completion_tokens: dict[str, int] = {}
        self.routes: dict[tuple[str, str], int] = {}  # (model, how) -> n
        self.latency: dict[str, Histogram] = {}  # by endpoint
        self.ttft: dict[str, Histogram] = {}  # by model
        self.itl: dict[str, Histogram] = {}  # by model

    def count_request(self, endpoint: str, model: str, code: int | str) -> None:
        key = (endpoint, model, str(code))
        self.requests[key] = self.requests.get(key, 0) + 1

    def add_tokens(self, model: str, prompt: int, completion: int) -> None:
        self.prompt_tokens[model] = self.prompt_tokens.get(model, 0) + prompt
        self.completion_tokens[model] = self.completion_tokens.get(model, 0) + completion

    def render(self, specialists: dict[str, Specialist]) -> str:
        lines: list[str] = []

        def family(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(f"{name}{labels} {_num(value)}" for labels, value in samples)

        family("megacpp_requests_total", "counter", "HTTP requests by endpoint, model and status "
               "(499: the client went away)",
               [(_labels(endpoint=e, model=m, code=c), n) for (e, m, c), n in
                sorted(self.requests.items())])
        family("megacpp_route_total", "counter", "Requests routed to each specialist, by how",
               [(_labels(model=m, how=h), n) for (m, h), n in sorted(self.routes.items())])
        family("megacpp_prompt_tokens_total", "counter", "Prompt tokens of finished requests",
               [(_labels(model=m), n) for m, n in sorted(self.prompt_tokens.items())])
        family("megacpp_generation_tokens_total", "counter", "Completion tokens sent",
               [(_labels(model=m), n) for m, n in sorted(self.completion_tokens.items())])
        gauges = [("running", "Sequences running"), ("waiting", "Requests in the waiting queue"),
                  ("free_blocks", "Free KV blocks"), ("total_blocks", "KV blocks"),
                  ("free_slots", "Free state slots"), ("total_slots", "State slots")]
        for field_, help_ in gauges:
            family(f"megacpp_engine_{field_}", "gauge", help_,
                   [(_labels(model=m), getattr(s.engine.stats, field_))
                    for m, s in specialists.items()])
        family("megacpp_engine_preemptions_total", "counter", "Sequences preempted (recomputed)",
               [(_labels(model=m), s.engine.stats.preemptions) for m, s in specialists.items()])
        family("megacpp_engine_steps_total", "counter", "Engine steps run",
               [(_labels(model=m), s.engine.steps) for m, s in specialists.items()])
        family("megacpp_engine_step_seconds_total", "counter", "Time inside engine steps",
               [(_labels(model=m), s.engine.step_seconds) for m, s in specialists.items()])
        family("megacpp_engine_up", "gauge", "1 while the engine thread runs",
               [(_labels(model=m), int(s.engine.running)) for m, s in specialists.items()])
        for name, help_, by, label in (
            ("megacpp_request_duration_seconds", "Request latency, arrival to last byte",
             self.latency, "endpoint"),
            ("megacpp_time_to_first_token_seconds", "Arrival to the first output token",
             self.ttft, "model"),
            ("megacpp_inter_token_latency_seconds", "Between consecutive outputs of a request",
             self.itl, "model"),
        ):
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} histogram")
            for key, hist in sorted(by.items()):
                cumulative = 0
                for bound, count in zip([*hist.buckets, math.inf], hist.counts):
                    cumulative += count
                    le = "+Inf" if bound == math.inf else _num(bound)
                    lines.append(f"{name}_bucket{_labels(**{label: key, 'le': le})} {cumulative}")
                lines.append(f"{name}_sum{_labels(**{label: key})} {_num(hist.sum)}")
                lines.append(f"{name}_count{_labels(**{label: key})} {cumulative}")
        return "\n".join(lines) + "\n"


def _num(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


# ---- errors ---------------------------------------------------------------------------------


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    # a message may quote what the client sent: lone surrogates are escaped to encode it
    message, param = (None if text is None else text.encode("utf-8", "backslashreplace").decode()
                      for text in (message, param))
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    problems, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return "the request body is not valid JSON", None
        where = ".".join(loc) or "body"
        param = param or where
        problems.append(f"{where}: {err.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(problems[:5]), param


def _engine_error(exc: BaseException) -> JSONResponse:
    from megacpp.infer.engine import QueueFull

    if isinstance(exc, QueueFull):
        return error_response(429, f"the server is busy: {exc}", "rate_limit_error",
                              code="queue_full")
    if isinstance(exc, EngineStopped):
        return error_response(503, str(exc), "service_unavailable")
    if isinstance(exc, UnknownModel):
        return error_response(404, str(exc), "invalid_request_error", "model",
                              "model_not_found")
    if isinstance(exc, BadRequest):
        return error_response(400, str(exc), "invalid_request_error", exc.param)
    if isinstance(exc, MegaCppError):
        return error_response(400, str(exc), "invalid_request_error")
    return error_response(500, f"internal error: {exc}", "server_error")


# ---- the app --------------------------------------------------------------------------------


@dataclass
class _Job:
    """One accepted request: what was asked and where it went."""

    endpoint: str  # "completions" | "chat"
    body: _Body
    specialist: Specialist
    route: Route
    request_id: str
    prompts: list[list[int]]
    index: dict[str, int]  # engine request id -> choice index
    arrived: float

    def headers(self) -> dict[str, str]:
        return {SPECIALIST_HEADER: self.specialist.name, ROUTE_HEADER: self.route.how}


class Server:
    """The state behind the app: specialists, router, metrics."""

    def __init__(self, specialists: Sequence[Specialist],
                 classifier: SnippetClassifier | None = None) -> None:
        self.specialists = {s.name: s for s in specialists}
        if len(self.specialists) != len(specialists):
            raise MegaCppError(f"specialist names must be distinct: {[s.name for s in specialists]}")
        self.router = Router([s.name for s in specialists], classifier)
        self.metrics = Metrics()

    def abort_all(self) -> None:
        """On shutdown: refuse new requests (503) and end every running one with
        finish_reason "abort", so each stream still gets its last chunk and ``[DONE]``."""
        for spec in self.specialists.values():
            spec.engine.abort_all()

    # -- building a job -------------------------------------------------------------------------
    def prepare(self, endpoint: str, body: _Body, arrived: float) -> tuple[_Job, list]:
        """Route, encode and validate; returns the job and the engine requests."""
        _refuse_unsupported(body)
        stops = _stops(body)
        if isinstance(body, ChatRequest):
            texts = [_message_text(m, i) for i, m in enumerate(body.messages)]
            prompt_texts, route_text = [render_chat(body.messages)], "\n".join(texts)
            stops = (*stops, CHAT_STOP)
        else:
            prompt_texts, route_text = None, None
        route = self.router.route(body.model, route_text if route_text is not None
                                  else self._prompt_text(body))
        spec = self.specialists[route.name]
        if prompt_texts is not None:
            prompts = [self._encode(spec, prompt_texts[0])]
        else:
            prompts = self._completion_prompts(spec, body)
        limit = spec.engine.engine.config.max_waiting
        if len(prompts) * body.n > limit:
            raise BadRequest(f"this request asks for {len(prompts) * body.n} sequences (prompts x "
                             f"n); the server queues at most {limit}", "n")
        prefix = "chatcmpl" if endpoint == "chat" else "cmpl"
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        requests, index = [], {}
        for p, ids in enumerate(prompts):
            max_tokens = self._max_tokens(spec, body, len(ids))
            for j in range(body.n):
                choice = p * body.n + j
                rid = f"{request_id}-{choice}"
                index[rid] = choice
                requests.append((rid, ids, self._params(body, max_tokens, stops, j)))
        return _Job(endpoint, body, spec, route, request_id, prompts, index, arrived), requests

    def _prompt_text(self, body: CompletionRequest) -> str:
        prompt = body.prompt
        if isinstance(prompt, str):
            return prompt
        if prompt and isinstance(prompt[0], str):
            return "\n".join(prompt)
        spec = next(iter(self.specialists.values()))
        rows = [prompt] if prompt and isinstance(prompt[0], int) else prompt
        return "\n".join(spec.tokenizer.decode(r) for r in rows if r and all(
            isinstance(t, int) and 0 <= t < spec.tokenizer.vocab_size for t in r))

    @staticmethod
    def _encode(spec: Specialist, text: str) -> list[int]:
        return [spec.tokenizer.bos_id, *spec.tokenizer.encode(text).tolist()]

    def _completion_prompts(self, spec: Specialist, body: CompletionRequest) -> list[list[int]]:
        prompt = body.prompt
        if isinstance(prompt, str):
            return [self._encode(spec, prompt)]
        if not prompt:
            raise BadRequest("prompt must not be empty", "prompt")
        if isinstance(prompt[0], str):
            return [self._encode(spec, p) for p in prompt]
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

    @staticmethod
    def _max_tokens(spec: Specialist, body: _Body, prompt_len: int) -> int:
        room = spec.max_model_len - prompt_len
        if room < 1:
            raise BadRequest(f"the prompt has {prompt_len} tokens; this model's context is "
                             f"{spec.max_model_len} tokens, which leaves no room to generate",
                             "prompt")
        asked = body.max_tokens
        if isinstance(body, ChatRequest):
            asked = body.max_completion_tokens or asked
        if asked is None:
            return room if isinstance(body, ChatRequest) else min(room, DEFAULT_COMPLETION_TOKENS)
        if prompt_len + asked > spec.max_model_len:
            raise BadRequest(f"the prompt ({prompt_len} tokens) plus max_tokens ({asked}) is "
                             f"more than this model's context of {spec.max_model_len} tokens",
                             "max_tokens")
        return asked

    @staticmethod
    def _params(body: _Body, max_tokens: int, stops: tuple[str, ...], j: int) -> SamplingParams:
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_k=body.top_k or 0,
            top_p=1.0 if body.top_p is None else body.top_p,
            max_new_tokens=max_tokens,
            stop=stops,
            seed=None if body.seed is None else body.seed + j,
            ignore_eos=body.ignore_eos,
        )

    # -- running it -----------------------------------------------------------------------------
    async def handle(self, endpoint: str, body: _Body, request: Request):
        arrived = time.perf_counter()
        model = body.model
        try:
            job, requests = self.prepare(endpoint, body, arrived)
            model = job.specialist.name
            stream = await job.specialist.engine.submit(requests)
        except Exception as exc:  # every refusal becomes an OpenAI error body
            response = _engine_error(exc)
            self.metrics.count_request(endpoint, model, response.status_code)
            if response.status_code == 500:
                log.exception("request failed")
            return response
        key = (job.specialist.name, job.route.how)
        self.metrics.routes[key] = self.metrics.routes.get(key, 0) + 1
        if body.stream:
            return _StreamResponse(self._sse(job, stream), stream, media_type="text/event-stream",
                                   headers={**job.headers(), "cache-control": "no-cache"})
        return await self._complete(job, stream, request)

    async def _outputs(self, job: _Job, stream: RequestStream) -> AsyncIterator[Any]:
        """The stream's outputs, with latency metrics."""
        model = job.specialist.name
        last: dict[str, float] = {}
        async for out in stream:
            now = time.perf_counter()
            if out.new_token_ids:
                if out.request_id not in last:
                    self.metrics.ttft.setdefault(model, Histogram()).observe(now - job.arrived)
                else:
                    self.metrics.itl.setdefault(model, Histogram()).observe(
                        now - last[out.request_id])
                last[out.request_id] = now
            yield out

    def _finish(self, job: _Job, code: int | str, prompt_tokens: int, completion_tokens: int):
        self.metrics.count_request(job.endpoint, job.specialist.name, code)
        self.metrics.add_tokens(job.specialist.name, prompt_tokens, completion_tokens)
        self.metrics.latency.setdefault(job.endpoint, Histogram()).observe(
            time.perf_counter() - job.arrived)

    async def _complete(self, job: _Job, stream: RequestStream, request: Request):
        """Collect a whole response; a client that disconnects meanwhile aborts it."""
        texts = {i: [] for i in job.index.values()}
        finish: dict[int, str] = {}
        usage = _Usage(job)

        async def collect() -> None:
            async for out in self._outputs(job, stream):
                i = job.index[out.request_id]
                texts[i].append(out.new_text)
                usage.add(out)
                if out.finished:
                    finish[i] = FINISH_REASONS.get(out.finish_reason, out.finish_reason)

        collector = asyncio.ensure_future(collect())
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not collector.done():
                collector.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await collector
            stream.close()
        if collector.cancelled() or not collector.done():
            self._finish(job, 499, usage.prompt, usage.completion)
            return PlainTextResponse("client disconnected", status_code=499)
        if (exc := collector.exception()) is not None:
            response = _engine_error(exc)
            self._finish(job, response.status_code, usage.prompt, usage.completion)
            return response
        choices = []
        for i in sorted(texts):
            text = "".join(texts[i])
            if job.endpoint == "chat":
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "logprobs": None, "finish_reason": finish.get(i)})
            else:
                choices.append({"index": i, "text": text, "logprobs": None,
                                "finish_reason": finish.get(i)})
        self._finish(job, 200, usage.prompt, usage.completion)
        body = {"id": job.request_id,
                "object": "chat.completion" if job.endpoint == "chat" else "text_completion",
                "created": int(time.time()), "model": job.specialist.name, "choices": choices,
                "usage": usage.to_dict()}
        return JSONResponse(body, headers=job.headers())

    async def _sse(self, job: _Job, stream: RequestStream) -> AsyncIterator[str]:
        chat = job.endpoint == "chat"
        usage = _Usage(job)
        created = int(time.time())
        base = {"id": job.request_id, "object": "chat.completion.chunk" if chat else
                "text_completion", "created": created, "model": job.specialist.name}
        code: int | str = 499  # unless it gets to the end

        def chunk(choices: list[dict], **extra: Any) -> str:
            return f"data: {json.dumps({**base, 'choices': choices, **extra})}\n\n"

        try:
            if chat:  # the role comes first, as OpenAI sends it
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}
                             for i in sorted(job.index.values())])
            async for out in self._outputs(job, stream):
                usage.add(out)
                if not out.new_text and not out.finished:
                    continue
                i = job.index[out.request_id]
                reason = FINISH_REASONS.get(out.finish_reason, out.finish_reason) \
                    if out.finished else None
                if chat:
                    delta = {"content": out.new_text} if out.new_text else {}
                    choice = {"index": i, "delta": delta, "logprobs": None,
                              "finish_reason": reason}
                else:
                    choice = {"index": i, "text": out.new_text, "logprobs": None,
                              "finish_reason": reason}
                yield chunk([choice])
            if (job.body.stream_options or {}).get("include_usage"):
                yield chunk([], usage=usage.to_dict())
            code = 200
        except (EngineFailure, EngineStopped) as exc:
            code = 500 if isinstance(exc, EngineFailure) else 503
            error = {"message": str(exc), "type": "server_error", "param": None, "code": None}
            yield f"data: {json.dumps({'error': error})}\n\n"
        finally:
            stream.close()
            self._finish(job, code, usage.prompt, usage.completion)
        yield "data: [DONE]\n\n"


class _Usage:
    """Token counts of a job: prompt tokens once per prompt, completion tokens per choice."""

    def __init__(self, job: _Job) -> None:
        self.prompt = sum(len(p) for p in job.prompts)
        self.completion = 0

    def add(self, out: Any) -> None:
        self.completion += len(out.new_token_ids)

    def to_dict(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt, "completion_tokens": self.completion,
                "total_tokens": self.prompt + self.completion}


class _StreamResponse(StreamingResponse):
    """A streaming response that aborts its requests however the stream ends (a client that
    disconnects cancels the sending task, which may be outside the body iterator)."""

    def __init__(self, content: AsyncIterator[str], stream: RequestStream, **kwargs: Any):
        super().__init__(content, **kwargs)
        self._stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except asyncio.CancelledError:  # uvicorn gave up waiting at shutdown: the end, quietly
            log.info("a stream was cut at shutdown (its client was not reading)")
        finally:
            self._stream.close()
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def create_app(specialists: Sequence[Specialist],
               classifier: SnippetClassifier | None = None) -> FastAPI:
    """The FastAPI app over ``specialists`` (their engines start and stop with the app)."""
    server = Server(specialists, classifier)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        for spec in server.specialists.values():
            if not spec.engine.running:
                spec.engine.start()
        try:
            yield
        finally:
            for spec in server.specialists.values():
                await spec.engine.shutdown()

    app = FastAPI(title="megacpp", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        endpoint = "chat" if request.url.path.endswith("chat/completions") else "completions"
        server.metrics.count_request(endpoint, "", 400)
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await server.handle("completions", body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        return await server.handle("chat", body, request)

    @app.get("/v1/models")
    async def models() -> dict:
        data = [{"id": s.name, "object": "model", "created": s.created, "owned_by": "megacpp",
                 "max_model_len": s.max_model_len, "checkpoint": s.checkpoint}
                for s in server.specialists.values()]
        if len(data) > 1 and server.router.classifier is not None:
            data.append({"id": AUTO, "object": "model", "created": data[0]["created"],
                         "owned_by": "megacpp", "specialists": list(server.specialists)})
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health() -> JSONResponse:
        engines = {name: ("ok" if s.engine.running else f"down: {s.engine.error or 'stopped'}")
                   for name, s in server.specialists.items()}
        ok = all(v == "ok" for v in engines.values())
        return JSONResponse({"status": "ok" if ok else "unavailable", "engines": engines},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(server.metrics.render(server.specialists),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
