"""The OpenAI-compatible wire protocol: the pydantic request bodies, the checks a body must
pass beyond its types (unsupported fields at their neutral value, stop strings), and the
OpenAI-shaped error bodies (``{"error": {"message", "type", "param", "code"}}``) each
failure becomes."""

from __future__ import annotations

from typing import Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from megacpp.errors import MegaCppError
from megacpp.infer.async_engine import EngineStopped
from megacpp.infer.router import UnknownModel
from megacpp.infer.sampling import MAX_LOGPROBS

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
MAX_STOP_SEQUENCES = 16
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}


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


class Body(_Strict):
    """Fields shared by both endpoints."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)  # 0: completions with echo only
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # extension
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: dict[str, bool] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False  # extension: generate past EOS (benchmarks)
    response_format: dict[str, Any] | None = None  # only {"type": "text"}: nothing is enforced
    # accepted only at their neutral value
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    best_of: int | None = None


class CompletionRequest(Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # top alternatives per token
    echo: bool = False  # the prompt comes back before the completion (with logprobs: its own)
    suffix: str | None = None  # fill in the middle: the text after the completion (jobs.py)


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]]  # required: this server has no tool calls


class ChatRequest(Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # needs logprobs=true
    tools: list[Any] | None = None


class BadRequest(MegaCppError):
    """An invalid request (HTTP 400); ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def refuse_unsupported(body: Body) -> None:
    """A :class:`BadRequest` for a field this server cannot honour, unless it is neutral."""
    neutral = {"presence_penalty": (None, 0), "frequency_penalty":
               (None, 0), "logit_bias": (None, {}), "best_of": (None, 1),
               "tools": (None, [])}
    for name, allowed in neutral.items():
        if name not in type(body).model_fields:
            continue
        value = getattr(body, name)
        if value not in allowed:
            raise BadRequest(f"{name}={value!r} is not supported by this server", name)
    refuse_unenforceable(body)


def refuse_unenforceable(body: Body) -> None:
    """A :class:`BadRequest` for a response_format other than text (nothing constrains the
    output here), for chat's top_logprobs without logprobs, and for max_tokens=0 except with
    a completion's echo (the prompt's logprobs, generating nothing); echo with a suffix."""
    fmt = body.response_format
    if fmt is not None and fmt != {"type": "text"}:
        kind = fmt.get("type") if isinstance(fmt.get("type"), str) else None
        what = f"response_format type {kind[:40]!r}" if kind else "this response_format"
        raise BadRequest(f"{what} is not supported: this server cannot constrain its output "
                         'to a format; only {"type": "text"} (or no response_format) is '
                         "accepted", "response_format")
    if isinstance(body, ChatRequest) and body.top_logprobs is not None and not body.logprobs:
        raise BadRequest("top_logprobs needs logprobs=true", "top_logprobs")
    if isinstance(body, CompletionRequest) and body.echo and body.suffix is not None:
        raise BadRequest("echo and suffix cannot be combined: a fill-in-the-middle prompt "
                         "is not the text that was sent", "echo")
    if body.max_tokens == 0 and not (isinstance(body, CompletionRequest) and body.echo):
        raise BadRequest("max_tokens=0 is accepted only on /v1/completions with echo=true "
                         "(it returns the prompt, and its logprobs, without generating)",
                         "max_tokens")


def stop_strings(body: Body) -> tuple[str, ...]:
    """The body's ``stop`` as a tuple of up to :data:`MAX_STOP_SEQUENCES` non-empty strings."""
    stop = body.stop
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOP_SEQUENCES or any(not s for s in stops):
        raise BadRequest(f"stop must be up to {MAX_STOP_SEQUENCES} non-empty strings", "stop")
    return stops


# ---- error bodies ---------------------------------------------------------------------------


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    # a message may quote what the client sent: lone surrogates are escaped to encode it
    message, param = (None if text is None else text.encode("utf-8", "backslashreplace").decode()
                      for text in (message, param))
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """FastAPI's validation errors as one message and the first offending field."""
    problems, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return "the request body is not valid JSON", None
        where = ".".join(loc) or "body"
        param = param or where
        problems.append(f"{where}: {err.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(problems[:5]), param


def engine_error(exc: BaseException) -> JSONResponse:
    """The error response for a refused or failed request: 429, 503, 404, 400 or 500."""
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
