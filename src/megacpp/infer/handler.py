"""The state behind the app (:class:`Server`: specialists, router, metrics) and how one
request runs: submit its engine requests, then answer with one JSON body, or with
Server-Sent Events (one ``data: {json}`` chunk per engine output that carries text, or
tokens when logprobs are asked, then ``data: [DONE]``), aborting the engine requests when the
client goes away. With ``echo``, a choice's prompt (and its logprobs) comes first."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from megacpp.errors import MegaCppError
from megacpp.infer.async_engine import EngineFailure, EngineStopped, RequestStream
from megacpp.infer.jobs import Job, Specialist, prepare_job
from megacpp.infer.logprobs import CompletionLogprobs, chat_logprobs, merge_pieces
from megacpp.infer.metrics import Metrics
from megacpp.infer.protocol import FINISH_REASONS, Body, engine_error
from megacpp.infer.router import Router, SnippetClassifier

log = logging.getLogger("megacpp.serve")


class Server:
    """The state behind the app: specialists, router, metrics."""

    def __init__(self, specialists: Sequence[Specialist],
                 classifier: SnippetClassifier | None = None) -> None:
        self.specialists = {s.name: s for s in specialists}
        if len(self.specialists) != len(specialists):
            raise MegaCppError(f"specialist names must be distinct: {[s.name for s in specialists]}")
        self.router = Router([s.name for s in specialists], classifier)
        self.metrics = Metrics(self.specialists)

    def abort_all(self) -> None:
        """On shutdown: refuse new requests (503) and end every running one with
        finish_reason "abort", so each stream still gets its last chunk and ``[DONE]``."""
        for spec in self.specialists.values():
            spec.engine.abort_all()

    async def handle(self, endpoint: str, body: Body, request: Request):
        arrived = time.perf_counter()
        model = body.model
        try:
            job, requests = prepare_job(endpoint, body, arrived, self.specialists, self.router)
            model = job.specialist.name
            stream = await job.specialist.engine.submit(requests)
        except Exception as exc:  # every refusal becomes an OpenAI error body
            response = engine_error(exc)
            self.metrics.count_request(endpoint, model, response.status_code)
            if response.status_code == 500:
                log.exception("request failed")
            return response
        self.metrics.count_route(job.specialist.name, job.route.how)
        if body.stream:
            return _StreamResponse(self._sse(job, stream), stream, media_type="text/event-stream",
                                   headers={**job.headers(), "cache-control": "no-cache"})
        return await self._complete(job, stream, request)

    async def _outputs(self, job: Job, stream: RequestStream) -> AsyncIterator[Any]:
        """The stream's outputs, with latency metrics."""
        model = job.specialist.name
        last: dict[str, float] = {}
        async for out in stream:
            now = time.perf_counter()
            if out.new_token_ids:
                if out.request_id not in last:
                    self.metrics.observe_first_token(model, now - job.arrived)
                else:
                    self.metrics.observe_inter_token(model, now - last[out.request_id])
                last[out.request_id] = now
            if not job.generates:  # echo with max_tokens=0: the sampled token is left out
                out = dataclasses.replace(out, new_token_ids=[], new_text="", logprobs=None,
                                          finish_reason="length" if out.finished else None,
                                          stop=None, completion_tokens=0)
            yield out

    def _finish(self, job: Job, code: int | str, prompt_tokens: int, completion_tokens: int):
        self.metrics.count_request(job.endpoint, job.specialist.name, code)
        self.metrics.add_tokens(job.specialist.name, prompt_tokens, completion_tokens)
        self.metrics.observe_latency(job.endpoint, time.perf_counter() - job.arrived)

    async def _complete(self, job: Job, stream: RequestStream, request: Request):
        """Collect a whole response; a client that disconnects meanwhile aborts it."""
        texts = {i: [] for i in job.index.values()}
        picks = {i: _Choice(job, i) for i in job.index.values()}
        logprobs: dict[int, list] = {i: [] for i in job.index.values()}
        finish: dict[int, str] = {}
        stop_reason: dict[int, str | None] = {}  # vLLM's field: the stop string, or null
        usage = _Usage(job)

        async def collect() -> None:
            async for out in self._outputs(job, stream):
                i = job.index[out.request_id]
                text, piece = picks[i].delta(out)
                texts[i].append(text)
                if piece is not None:
                    logprobs[i].append(piece)
                usage.add(out)
                if out.finished:
                    finish[i] = FINISH_REASONS.get(out.finish_reason, out.finish_reason)
                    stop_reason[i] = out.stop

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
            response = engine_error(exc)
            self._finish(job, response.status_code, usage.prompt, usage.completion)
            return response
        choices = []
        for i in sorted(texts):
            text = "".join(texts[i])
            lp = picks[i].merged(logprobs[i])
            if job.endpoint == "chat":
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "logprobs": lp, "finish_reason": finish.get(i),
                                "stop_reason": stop_reason.get(i)})
            else:
                choices.append({"index": i, "text": text, "logprobs": lp,
                                "finish_reason": finish.get(i), "stop_reason": stop_reason.get(i)})
        self._finish(job, 200, usage.prompt, usage.completion)
        body = {"id": job.request_id,
                "object": "chat.completion" if job.endpoint == "chat" else "text_completion",
                "created": int(time.time()), "model": job.specialist.name, "choices": choices,
                "usage": usage.to_dict()}
        return JSONResponse(body, headers=job.headers())

    async def _sse(self, job: Job, stream: RequestStream) -> AsyncIterator[str]:
        chat = job.endpoint == "chat"
        usage = _Usage(job)
        created = int(time.time())
        base = {"id": job.request_id, "object": "chat.completion.chunk" if chat else
                "text_completion", "created": created, "model": job.specialist.name}
        code: int | str = 499  # unless it gets to the end
        picks = {i: _Choice(job, i) for i in job.index.values()}

        def chunk(choices: list[dict], **extra: Any) -> str:
            return f"data: {json.dumps({**base, 'choices': choices, **extra})}\n\n"

        try:
            if chat:  # the role comes first, as OpenAI sends it
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}
                             for i in sorted(job.index.values())])
            async for out in self._outputs(job, stream):
                usage.add(out)
                i = job.index[out.request_id]
                text, logprobs = picks[i].delta(out)
                if not text and not out.finished and (logprobs is None or not out.new_token_ids):
                    continue
                reason = FINISH_REASONS.get(out.finish_reason, out.finish_reason) \
                    if out.finished else None
                ended = {"finish_reason": reason, "stop_reason": out.stop if out.finished else None}
                if chat:
                    delta = {"content": text} if text else {}
                    choice = {"index": i, "delta": delta, "logprobs": logprobs, **ended}
                else:
                    choice = {"index": i, "text": text, "logprobs": logprobs, **ended}
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


class _Choice:
    """One choice's text and logprobs as its outputs arrive: with echo, the prompt (and its
    logprobs) comes first; logprobs in the request's wire format, or None when not asked."""

    def __init__(self, job: Job, index: int) -> None:
        self.job = job
        self.tokenizer = job.specialist.tokenizer
        self.prompt = job.prompts[index // job.body.n]
        self.chat = job.endpoint == "chat"
        self.wants_logprobs = bool(job.body.logprobs) if self.chat else (
            job.body.logprobs is not None)
        self.completion = None if self.chat or not self.wants_logprobs else (
            CompletionLogprobs(self.tokenizer))
        self.started = False

    def delta(self, out: Any) -> tuple[str, dict | None]:
        """The text and the logprobs object that ``out`` adds to the choice."""
        text, pieces = out.new_text, []
        ids, entries = out.new_token_ids, out.logprobs or [None] * len(out.new_token_ids)
        if not self.started:
            self.started = True
            if self.job.echo:
                text = self.tokenizer.decode(self.prompt) + text
                if self.completion is not None:
                    prompt_entries = out.prompt_logprobs or [None] * len(self.prompt)
                    pieces.append(self.completion.piece(self.prompt, prompt_entries))
        if not self.wants_logprobs:
            return text, None
        if self.chat:
            return text, chat_logprobs(self.tokenizer, out.logprobs or [])
        pieces.append(self.completion.piece(ids, entries))
        return text, merge_pieces(pieces)

    def merged(self, pieces: list[dict]) -> dict | None:
        """The deltas' logprobs objects as one (a whole response)."""
        if not self.wants_logprobs:
            return None
        if self.chat:
            return {"content": [item for p in pieces for item in p["content"]]}
        return merge_pieces(pieces)


class _Usage:
    """Token counts of a job: prompt tokens once per prompt, completion tokens per choice."""

    def __init__(self, job: Job) -> None:
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
