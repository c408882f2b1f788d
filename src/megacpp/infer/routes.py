"""The FastAPI app: its routes (``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``, ``GET /health``, ``GET /metrics``), the error handlers that give every
refusal an OpenAI-shaped body (FastAPI's 422 for an invalid body becomes 400), and the
lifespan that starts and stops the specialists' engines."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from megacpp.errors import MegaCppError
from megacpp.infer.adapters import AdapterSet
from megacpp.infer.handler import Server
from megacpp.infer.jobs import Specialist
from megacpp.infer.metrics import CONTENT_TYPE
from megacpp.infer.protocol import (
    ChatRequest,
    CompletionRequest,
    error_response,
    validation_message,
)
from megacpp.infer.router import AUTO, SnippetClassifier


def create_app(specialists: Sequence[Specialist],
               classifier: SnippetClassifier | None = None,
               adapters: AdapterSet | None = None) -> FastAPI:
    """The FastAPI app over ``specialists`` (their engines start and stop with the app);
    ``adapters`` (:mod:`megacpp.infer.adapters`) names the LoRA specialists among them and,
    when it allows, adds the routes that load and unload adapters at run time."""
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
        message, param = validation_message(exc)
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
        lora = adapters.loaded if adapters is not None else {}
        data = [{"id": s.name, "object": "model", "created": s.created, "owned_by": "megacpp",
                 "max_model_len": s.max_model_len, "checkpoint": s.checkpoint,
                 **({"parent": adapters.base.name} if s.name in lora else {})}
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
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    if adapters is not None and adapters.runtime:
        _adapter_routes(app, server, adapters)
    return app


class LoadLora(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLora(BaseModel):
    lora_name: str


def _adapter_routes(app: FastAPI, server: Server, adapters: AdapterSet) -> None:
    """``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's routes)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora(body: LoadLora) -> JSONResponse:
        try:
            return JSONResponse(await adapters.load(server, body.lora_name, body.lora_path))
        except MegaCppError as exc:
            return error_response(400, str(exc), "invalid_request_error", "lora_path")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(body: UnloadLora) -> JSONResponse:
        try:
            return JSONResponse(await adapters.unload(server, body.lora_name))
        except MegaCppError as exc:
            return error_response(404, str(exc), "invalid_request_error", "lora_name")
