"""Sample completions from any OpenAI-compatible ``/v1/completions`` endpoint (vLLM, TGI,
``megacpp serve``), for the verifier to score.

Each problem is one request (or one per ``n_per_request`` of its samples, for servers that
cap or ignore ``n``) carrying ``model``, ``prompt``, ``n``, ``temperature``, ``top_p``,
``max_tokens``, ``stop`` and ``seed``; at most ``concurrency`` requests are in flight.
Connection errors, timeouts, 408, 429 and 5xx answers are retried with exponential backoff
(a numeric ``Retry-After`` is honoured). Anything else stops the run with one error naming
the endpoint and what it answered: a refused URL, model name, key or request is the caller's
to fix (exit status 2); an unreachable or misbehaving server is a runtime failure (1).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from megacpp._io import JSON_LIMIT
from megacpp.errors import MegaCppError, describe_error
from megacpp.eval.harness import SamplingSettings

RETRY_STATUSES = frozenset({408, 429})  # and every 5xx
MAX_BACKOFF_S = 30.0  # the longest wait between attempts, Retry-After included
CONNECT_TIMEOUT_S = 10.0
URL_EXAMPLE = "http://127.0.0.1:8000/v1"


class EndpointError(MegaCppError):
    """The endpoint could not be reached or answered something unusable (exit status 1)."""

    exit_code = 1


@dataclass(frozen=True)
class Endpoint:
    """Where to send completion requests and how hard to try."""

    url: str  # the completions URL, from :func:`completions_url`
    model: str  # the model name sent with each request
    api_key: str | None = None  # sent as a bearer token
    timeout_s: float = 600.0  # one request, connect to last byte
    retries: int = 3  # further attempts after a retryable failure
    concurrency: int = 8  # requests in flight at most
    n_per_request: int | None = None  # completions asked per request (None: all n at once)
    backoff_s: float = 0.5  # the first wait; doubled after each failed attempt

    def __post_init__(self) -> None:
        if not self.model:
            raise MegaCppError("--model must name the model the endpoint serves")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise MegaCppError(f"--request-timeout {self.timeout_s}: expected seconds > 0")
        if not 0 <= self.retries <= 100:
            raise MegaCppError(f"--retries {self.retries}: expected 0 to 100")
        if not 1 <= self.concurrency <= 1024:
            raise MegaCppError(f"--concurrency {self.concurrency}: expected 1 to 1024")
        if self.n_per_request is not None and self.n_per_request < 1:
            raise MegaCppError(f"--n-per-request {self.n_per_request}: expected >= 1")

    def public_url(self) -> str:
        """The URL without any user:password part, as recorded in receipts."""
        return str(httpx.URL(self.url).copy_with(username=None, password=None))


@dataclass(frozen=True)
class Completion:
    text: str
    # "stop" (a stop sequence ended it), "eos", "length", or what the server said
    finish_reason: str | None


@dataclass
class EndpointSamples:
    completions: list[list[Completion]]  # [prompt][sample], in prompt order
    served_models: list[str]  # the distinct `model` fields of the responses, first seen first
    requests: int = 0  # completed requests
    retried: int = 0  # attempts repeated after a retryable failure

    def served_name(self) -> str | list[str] | None:
        """The served model as a receipt records it: the one name, every name where the
        responses named several, None where none named one."""
        served = self.served_models
        return served[0] if len(served) == 1 else (served or None)


def completions_url(url: str) -> str:
    """The ``/v1/completions`` URL of a server given by its base URL (with or without
    ``/v1``) or by the completions URL itself."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as exc:
        raise MegaCppError(f"--endpoint {url!r} is not a URL ({exc}); expected e.g. "
                           f"{URL_EXAMPLE}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise MegaCppError(f"--endpoint {url!r}: expected an http:// or https:// URL of an "
                           f"OpenAI-compatible server, e.g. {URL_EXAMPLE}")
    path = parsed.path.rstrip("/")
    if path.endswith("/chat/completions"):
        raise MegaCppError(f"--endpoint {url!r} is a chat route; give the server's base URL "
                           f"(e.g. {URL_EXAMPLE}): evaluation uses /v1/completions")
    if not path.endswith("/completions"):
        path += "/completions" if path.endswith("/v1") else "/v1/completions"
    return str(parsed.copy_with(path=path))


def sample_endpoint(
    endpoint: Endpoint,
    prompts: Sequence[str],
    settings: SamplingSettings,
    stop: Sequence[str] = (),
    *,
    names: Sequence[str] | None = None,
    on_completion: Callable[[Completion], None] | None = None,
    suffixes: Sequence[str] | None = None,
) -> EndpointSamples:
    """``settings.n`` completions of every prompt from ``endpoint``, in prompt order.
    ``names`` (e.g. task ids) name the prompts in errors; ``on_completion`` is called once
    per completion received (progress); ``suffixes`` (one per prompt) are sent as each
    request's ``suffix``: fill in the middle."""
    names = list(names) if names is not None else [f"prompt {p}" for p in range(len(prompts))]
    per_request = endpoint.n_per_request or settings.n
    chunks = [(p, start, min(per_request, settings.n - start))
              for p in range(len(prompts)) for start in range(0, settings.n, per_request)]
    result = EndpointSamples(completions=[[] for _ in prompts], served_models=[])
    return asyncio.run(_sample_all(endpoint, prompts, names, settings, tuple(stop), chunks,
                                   result, on_completion, suffixes))


async def _sample_all(endpoint: Endpoint, prompts: Sequence[str], names: Sequence[str],
                      settings: SamplingSettings, stop: tuple[str, ...],
                      chunks: list[tuple[int, int, int]], result: EndpointSamples,
                      on_completion: Callable[[Completion], None] | None,
                      suffixes: Sequence[str] | None = None) -> EndpointSamples:
    pieces: dict[tuple[int, int], list[Completion]] = {}
    pending = iter(chunks)
    headers = {"authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
    timeout = httpx.Timeout(endpoint.timeout_s, connect=min(endpoint.timeout_s, CONNECT_TIMEOUT_S))
    limits = httpx.Limits(max_connections=endpoint.concurrency)

    async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits,
                                 follow_redirects=False) as client:
        async def worker() -> None:
            for p, start, count in pending:  # one shared iterator: each chunk goes to one worker
                body = _request_body(endpoint, prompts[p], settings, stop, start, count)
                if suffixes is not None:
                    body["suffix"] = suffixes[p]
                answer = await _post(client, endpoint, body, names[p], result)
                completions, model = _parse_completions(answer, count, endpoint, names[p])
                if model is not None and model not in result.served_models:
                    result.served_models.append(model)
                pieces[(p, start)] = completions
                result.requests += 1
                for completion in completions:
                    if on_completion is not None:
                        on_completion(completion)

        try:
            async with asyncio.TaskGroup() as group:
                for _ in range(min(endpoint.concurrency, len(chunks))):
                    group.create_task(worker())
        except ExceptionGroup as failures:  # the first failure cancelled the other workers
            first = failures.exceptions[0]
            if isinstance(first, MegaCppError):
                raise first from None
            raise
    for p, start, _ in chunks:
        result.completions[p].extend(pieces[(p, start)])
    return result


def _request_body(endpoint: Endpoint, prompt: str, settings: SamplingSettings,
                  stop: tuple[str, ...], start: int, count: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": endpoint.model, "prompt": prompt, "n": count,
                            "temperature": settings.temperature}
    if settings.top_p is not None:
        body["top_p"] = settings.top_p
    if settings.max_new_tokens is not None:
        body["max_tokens"] = settings.max_new_tokens
    if stop:
        body["stop"] = list(stop)
    if settings.seed is not None:  # a different seed for each request of one prompt
        body["seed"] = settings.seed + start
    return body


async def _post(client: httpx.AsyncClient, endpoint: Endpoint, body: dict[str, Any], what: str,
                result: EndpointSamples) -> Any:
    """The decoded JSON answer to one request, retrying what is worth retrying."""
    failure = ""
    for attempt in range(endpoint.retries + 1):
        wait_s = min(MAX_BACKOFF_S, endpoint.backoff_s * 2 ** attempt)
        try:
            status, headers, content = await asyncio.wait_for(
                _send(client, endpoint, body), endpoint.timeout_s)
        except (httpx.TransportError, TimeoutError) as exc:  # refused, reset, timed out
            failure = (f"no response within {endpoint.timeout_s:g} s"
                       if isinstance(exc, TimeoutError | httpx.TimeoutException)
                       else _transport_failure(exc))
        else:
            if 200 <= status < 300:
                return _decode(content, endpoint, what)
            if status not in RETRY_STATUSES and status < 500:
                raise await _refusal(client, endpoint, status, content)
            failure = f"HTTP {status} ({_error_message(content)})"
            wait_s = _retry_after(headers.get("retry-after"), wait_s)
        if attempt < endpoint.retries:
            result.retried += 1
            await asyncio.sleep(wait_s)
    raise EndpointError(f"{endpoint.public_url()}: no usable answer for {what} after "
                        f"{endpoint.retries + 1} attempt(s); the last: {failure}")


def _transport_failure(exc: BaseException) -> str:
    """The error and, where it wraps one, the operating system's reason (httpx says "All
    connection attempts failed"; the OSError beneath it is ConnectionRefusedError)."""
    cause = exc.__cause__ or exc.__context__
    for _ in range(8):  # a short chain; never loop on a cyclic one
        if cause is None or (isinstance(cause, OSError) and cause.errno):
            break
        cause = cause.__cause__ or cause.__context__
    else:
        cause = None
    reason = f" ({describe_error(cause)})" if cause is not None else ""
    return describe_error(exc) + reason


async def _send(client: httpx.AsyncClient, endpoint: Endpoint,
                body: dict[str, Any]) -> tuple[int, httpx.Headers, bytes]:
    """POST ``body``; the status, headers and body, read up to JSON_LIMIT bytes."""
    async with client.stream("POST", endpoint.url, json=body) as response:
        content = bytearray()
        async for chunk in response.aiter_bytes():
            content += chunk
            if len(content) > JSON_LIMIT:
                raise EndpointError(f"{endpoint.public_url()} sent a response of more than "
                                    f"{JSON_LIMIT >> 20} MiB; refusing to read it")
        return response.status_code, response.headers, bytes(content)


def _retry_after(value: str | None, default: float) -> float:
    try:
        seconds = float(value) if value is not None else default
    except ValueError:  # an HTTP date: not worth parsing, back off as usual
        return default
    return min(MAX_BACKOFF_S, seconds) if math.isfinite(seconds) and seconds >= 0 else default


def _error_message(content: bytes) -> str:
    """The message of an error body: OpenAI/vLLM ``{"error": {"message"}}``, TGI
    ``{"error": "..."}``, FastAPI ``{"detail": ...}``, else the start of the text."""
    try:
        body = json.loads(content)
    except (ValueError, UnicodeDecodeError):
        text = content.decode("utf-8", "replace").strip()
        return (text[:200] + "...") if len(text) > 200 else text or "empty body"
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"][:300]
        for key in ("error", "detail", "message"):
            if isinstance(body.get(key), str):
                return body[key][:300]
    return json.dumps(body)[:200]


def _error_param(content: bytes) -> str | None:
    """The request field an OpenAI-shaped error body names (``error.param``), if any."""
    try:
        body = json.loads(content)
    except (ValueError, UnicodeDecodeError):
        return None
    error = body.get("error") if isinstance(body, dict) else None
    param = error.get("param") if isinstance(error, dict) else None
    return param if isinstance(param, str) else None


async def _refusal(client: httpx.AsyncClient, endpoint: Endpoint, status: int,
                   content: bytes) -> MegaCppError:
    """The error for a non-retryable answer: the request, URL, key or model is wrong."""
    url, message, param = endpoint.public_url(), _error_message(content), _error_param(content)
    about_model = param == "model" or (param is None and "model" in message.lower())
    if status in (400, 404, 422) and about_model:
        served = await _served_models(client, endpoint)
        hint = f"; it serves: {', '.join(served)}" if served else ""
        return MegaCppError(f"{url} does not serve model {endpoint.model!r} (HTTP {status}: "
                            f"{message}){hint}")
    if status in (401, 403):
        return MegaCppError(f"{url} refused the request (HTTP {status}: {message}); pass the "
                            f"server's key with --api-key or $OPENAI_API_KEY")
    if status in (404, 405) or 300 <= status < 400:
        return MegaCppError(f"{url} answered HTTP {status} ({message}): is --endpoint the "
                            f"server's base URL, e.g. {URL_EXAMPLE}?")
    hint = "; pass a smaller --n-per-request" if param == "n" else ""
    return MegaCppError(f"{url} refused the request (HTTP {status}: {message}){hint}")


async def _served_models(client: httpx.AsyncClient, endpoint: Endpoint) -> list[str]:
    """The model ids ``GET /v1/models`` lists, or none when that fails (best effort)."""
    models_url = endpoint.url.rsplit("/completions", 1)[0] + "/models"
    try:
        response = await asyncio.wait_for(client.get(models_url), CONNECT_TIMEOUT_S)
        data = response.json().get("data", [])
        return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)][:20]
    except (httpx.HTTPError, TimeoutError, ValueError, AttributeError, TypeError):
        return []


def _decode(content: bytes, endpoint: Endpoint, what: str) -> Any:
    try:
        return json.loads(content)
    except (ValueError, UnicodeDecodeError):
        start = content[:80].decode("utf-8", "replace")
        raise EndpointError(f"{endpoint.public_url()} answered {what} with a body that is not "
                            f"JSON: {start!r}") from None


def _parse_completions(answer: Any, count: int, endpoint: Endpoint,
                       what: str) -> tuple[list[Completion], str | None]:
    """The ``count`` completions of a ``/v1/completions`` response, in choice order, and the
    model name it reports."""

    def malformed(problem: str) -> EndpointError:
        return EndpointError(f"{endpoint.public_url()} answered {what} with a malformed "
                             f"completion response: {problem}")

    if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
        raise malformed("no 'choices' list")
    choices = answer["choices"]
    if len(choices) != count:
        raise malformed(f"{len(choices)} choice(s) for n={count} (for a server that caps or "
                        f"ignores n, pass --n-per-request)")
    if not all(isinstance(c, dict) and isinstance(c.get("text"), str) for c in choices):
        raise malformed("a choice without a string 'text'")
    indexes = [c.get("index") for c in choices]
    if all(isinstance(i, int) for i in indexes):
        if sorted(indexes) != list(range(count)):
            raise malformed(f"choice indexes {indexes} are not 0..{count - 1}")
        choices = sorted(choices, key=lambda c: c["index"])
    model = answer.get("model")
    if model is not None and not isinstance(model, str):
        raise malformed("'model' is not a string")
    return [Completion(c["text"], _finish_reason(c)) for c in choices], model


def _finish_reason(choice: dict[str, Any]) -> str | None:
    """The choice's finish reason; where the server says which stop ended it (vLLM's
    ``stop_reason``: the stop string, a stop token id, or null for end-of-sequence), a
    "stop" that was no stop string becomes "eos"."""
    reason = choice.get("finish_reason")
    reason = reason if isinstance(reason, str) else None
    if reason == "stop" and "stop_reason" in choice and not isinstance(choice["stop_reason"], str):
        return "eos"
    return reason
