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
``stream_options.include_usage``, plus the extensions ``top_k`` and ``ignore_eos``.
Completions take ``logprobs`` (0..20), ``echo`` (with ``max_tokens`` 0: the prompt's
logprobs only) and ``suffix`` (fill in the middle, see jobs.py); chat takes ``logprobs`` and
``top_logprobs`` (:mod:`megacpp.infer.logprobs`). Fields this server cannot honour
(penalties, ``logit_bias``, ``best_of`` > 1, tools) are refused with 400 unless they are at
their neutral value, and so is a ``response_format`` other than ``{"type": "text"}``; other
unknown fields are ignored. A string prompt is encoded with BOS first; a prompt of
token ids is used as is. ``max_tokens`` defaults to 16 for completions (as OpenAI) and to
the rest of the context for chat.

The chat template (:mod:`megacpp.infer.chat_template`) makes a conversation a C++ file
in which instructions are comments and answers are code; ``"\\n// user:"`` is always a stop
sequence. Routing (``model: "auto"``) classifies the messages' raw text, since the C++ lexer
drops comments.

The chosen specialist is the response's ``model`` field and its ``x-megacpp-specialist``
header; ``x-megacpp-route`` says how it was chosen (``model``, ``auto`` or ``default``).

The code, by concern: :mod:`~megacpp.infer.protocol` (request bodies and error bodies),
:mod:`~megacpp.infer.chat_template`, :mod:`~megacpp.infer.jobs` (a body to engine requests),
:mod:`~megacpp.infer.handler` (running a request: JSON or SSE), :mod:`~megacpp.infer.routes`
(the FastAPI app) and :mod:`~megacpp.infer.metrics` (Prometheus). This module gathers the
names a caller needs.
"""

from megacpp.infer.chat_template import CHAT_STOP, render_chat
from megacpp.infer.handler import Server
from megacpp.infer.jobs import Specialist
from megacpp.infer.protocol import BadRequest, ChatMessage, ChatRequest, CompletionRequest
from megacpp.infer.routes import create_app

__all__ = ["CHAT_STOP", "BadRequest", "ChatMessage", "ChatRequest", "CompletionRequest", "Server",
           "Specialist", "create_app", "render_chat"]
