"""Offline batch generation: many requests through one :class:`~megacpp.infer.engine.Engine`.

The engine batches every running sequence into one decode step (CUDA graphs on a GPU), so a
whole evaluation set -- e.g. 164 prompts x 21 samples -- runs as one continuous batch instead
of prompt by prompt. Requests are fed as the engine's waiting queue has room; results come
back by request id.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from megacpp.infer.engine import Engine
from megacpp.infer.sampling import SamplingParams

CPP_BODY_STOP = "\n}"  # a closing brace in column 0 ends the function being completed


def close_function_body(text: str, finish_reason: str) -> str:
    """A function-body completion stopped at :data:`CPP_BODY_STOP` with that brace put back,
    so prompt + completion is the whole function; any other ending is left as it is."""
    return text + CPP_BODY_STOP + "\n" if finish_reason == "stop" else text


@dataclass(frozen=True)
class BatchRequest:
    request_id: str
    prompt: str
    params: SamplingParams


@dataclass
class BatchResult:
    text: str  # stop-aware: never holds the stop string or anything after it
    finish_reason: str  # "stop" | "eos" | "length"
    completion_tokens: int
    token_ids: list[int] = field(default_factory=list)  # every sampled token, EOS included
    stop: str | None = None  # the stop string that ended it (finish_reason "stop")

    def function_body(self) -> str:
        """The completion of a C++ function whose prompt ends inside its body, with its closing
        brace put back (:func:`close_function_body`)."""
        return close_function_body(self.text, self.finish_reason)


def run_batch(engine: Engine, requests: Iterable[BatchRequest],
              on_finish: Callable[[str, BatchResult], None] | None = None) -> dict[str, BatchResult]:
    """Run every request to completion; results by request id. ``on_finish`` is called as
    each one finishes (progress)."""
    pending = iter(requests)
    texts: dict[str, list[str]] = {}
    token_ids: dict[str, list[int]] = {}
    results: dict[str, BatchResult] = {}
    exhausted = False
    while True:
        while not exhausted and len(engine.scheduler.waiting) < engine.config.max_waiting:
            request = next(pending, None)
            if request is None:
                exhausted = True
                break
            engine.add_request(request.request_id, request.prompt, request.params)
            texts[request.request_id], token_ids[request.request_id] = [], []
        if not engine.has_unfinished():
            if exhausted:
                return results
            continue
        for out in engine.step():
            texts[out.request_id].append(out.new_text)
            token_ids[out.request_id] += out.new_token_ids
            if out.finished:
                result = BatchResult("".join(texts.pop(out.request_id)), out.finish_reason,
                                     out.completion_tokens, token_ids.pop(out.request_id),
                                     out.stop)
                results[out.request_id] = result
                if on_finish is not None:
                    on_finish(out.request_id, result)
