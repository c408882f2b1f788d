"""An asyncio front for the single-threaded :class:`~megacpp.infer.engine.Engine`.

One background thread owns the engine: it is the only caller of ``add_request``, ``abort``
and ``step``. The event loop talks to it through a thread-safe command queue; outputs come
back to each consumer's ``asyncio.Queue`` through ``loop.call_soon_threadsafe`` (one
callback per engine step, carrying every output of that step).

Usage (inside a running event loop)::

    engine = AsyncEngine(Engine(...)); engine.start()
    stream = await engine.submit([(request_id, prompt, params)])   # raises QueueFull here
    async for out in stream: ...      # RequestOutput of every request of the group
    await engine.shutdown()

:meth:`submit` returns only once the engine accepted every request of the group, so a
server can still answer 429 / 400 before it sends its first byte. A group (``n`` samples of
one prompt, or several prompts) is admitted whole or not at all. A consumer that stops
early -- a client disconnect cancels its task, ``break`` closes the iterator -- aborts its
unfinished requests, which frees their KV blocks and state slots at once.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from megacpp.errors import MegaCppError

log = logging.getLogger("megacpp.serve")

_IDLE_WAIT_S = 0.5  # how long the idle thread blocks on the command queue between checks


class EngineStopped(MegaCppError):
    """The engine thread is not running (not started, shut down, or crashed)."""


class EngineFailure(Exception):
    """The engine raised while stepping: its requests end with this error (HTTP 500)."""


@dataclass
class _Consumer:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue  # RequestOutput | BaseException
    request_ids: tuple[str, ...]


@dataclass
class _Add:
    requests: list[tuple[str, Any, Any]]  # (request_id, prompt, SamplingParams)
    consumer: _Consumer
    accepted: asyncio.Future  # resolved with None or the exception that refused the group


@dataclass
class _Abort:
    request_ids: tuple[str, ...]


class _AbortAll:
    pass


class _Stop:
    pass


class RequestStream:
    """The outputs of one submitted group, in engine order; see the module docstring."""

    def __init__(self, owner: AsyncEngine, consumer: _Consumer) -> None:
        self._owner = owner
        self._consumer = consumer
        self._open = set(consumer.request_ids)

    @property
    def request_ids(self) -> tuple[str, ...]:
        return self._consumer.request_ids

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        try:
            while self._open:
                item = await self._consumer.outputs.get()
                if isinstance(item, BaseException):
                    self._open.clear()
                    raise item
                if item.finished:
                    self._open.discard(item.request_id)
                yield item
        finally:
            self.close()

    def close(self) -> None:
        """Abort whatever of the group is still running (idempotent)."""
        if self._open:
            self._owner._abort(tuple(self._open))
            self._open.clear()


class AsyncEngine:
    """Drives ``engine.step()`` on a background thread; see the module docstring."""

    def __init__(self, engine: Any, name: str = "engine") -> None:
        self.engine = engine
        self.name = name
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._consumers: dict[str, _Consumer] = {}  # thread-owned: request_id -> consumer
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._draining = threading.Event()  # abort_all() was called: refuse new requests
        self.stats = engine.stats()  # a snapshot, refreshed by the thread after every round
        self.steps = 0
        self.step_seconds = 0.0  # cumulative time inside engine.step()
        self.error: BaseException | None = None  # the last engine failure, for /health

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() called twice")
        self._thread = threading.Thread(target=self._run, name=f"megacpp-{self.name}",
                                        daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the thread; requests still running end with :class:`EngineStopped`."""
        self.stop()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)

    def stop(self) -> None:
        """Ask the thread to stop (non-blocking; safe from any thread)."""
        self._stopping.set()
        self._commands.put(_Stop())

    def abort_all(self) -> None:
        """Refuse new requests and abort every running one, whose consumers then get a last
        output finished with reason "abort" (non-blocking; safe from any thread or a signal
        handler): what a server does when it is told to stop."""
        self._draining.set()
        self._commands.put(_AbortAll())

    # -- the event-loop side --------------------------------------------------------------------
    async def submit(self, requests: Sequence[tuple[str, Any, Any]]) -> RequestStream:
        """Add a group of ``(request_id, prompt, params)``; returns once the engine accepted
        all of them. Raises the engine's error (``QueueFull``, ``MegaCppError``) otherwise."""
        if not requests:
            raise MegaCppError("no requests to submit")
        if not self.running:
            raise EngineStopped(f"the {self.name} engine is not running")
        if self._draining.is_set():
            raise EngineStopped(f"the {self.name} engine is shutting down")
        loop = asyncio.get_running_loop()
        consumer = _Consumer(loop, asyncio.Queue(), tuple(r[0] for r in requests))
        accepted = loop.create_future()
        self._commands.put(_Add(list(requests), consumer, accepted))
        stream = RequestStream(self, consumer)
        try:
            while not accepted.done():  # the thread may stop before it sees the command
                await asyncio.wait({accepted}, timeout=_IDLE_WAIT_S)
                if not accepted.done() and not self._thread.is_alive():
                    raise EngineStopped(f"the {self.name} engine stopped")
            accepted.result()
        except asyncio.CancelledError:
            stream.close()  # it may have been accepted after all
            raise
        return stream

    async def generate(self, request_id: str, prompt: Any, params: Any) -> AsyncIterator[Any]:
        """The outputs of one request (a convenience over :meth:`submit`)."""
        stream = await self.submit([(request_id, prompt, params)])
        async for out in stream:
            yield out

    def _abort(self, request_ids: tuple[str, ...]) -> None:
        self._commands.put(_Abort(request_ids))

    # -- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                busy = self.engine.has_unfinished()
                self._drain(block=not busy)
                if self._stopping.is_set():
                    break
                if self.engine.has_unfinished():
                    self._step()
                self.stats = self.engine.stats()
        except BaseException as exc:  # a crashed thread must not hang clients
            log.exception("the %s engine thread crashed", self.name)
            self.error = exc
        finally:
            self._stopping.set()
            self._fail_all(EngineStopped(f"the {self.name} engine stopped"))

    def _drain(self, block: bool) -> None:
        """Apply queued commands; when ``block``, wait (a while) for the first one."""
        try:
            command = self._commands.get(timeout=_IDLE_WAIT_S) if block else \
                self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(command, _Stop):
                return
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Abort):
                for rid in command.request_ids:
                    if self._consumers.pop(rid, None) is not None:
                        self.engine.abort(rid)
            elif isinstance(command, _AbortAll):  # consumers stay: they hear the "abort"
                for rid in list(self._consumers):
                    self.engine.abort(rid)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, command: _Add) -> None:
        added: list[str] = []
        try:
            for rid, prompt, params in command.requests:
                if rid in self._consumers:
                    raise MegaCppError(f"request id {rid!r} is already running")
                self.engine.add_request(rid, prompt, params)
                added.append(rid)
                self._consumers[rid] = command.consumer
        except Exception as exc:  # noqa: BLE001 - refused: undo the part of the group that got in
            for rid in added:  # their "abort" outputs find no consumer and are dropped
                self._consumers.pop(rid, None)
                self.engine.abort(rid)
            _resolve(command.accepted, exc)
            return
        self.stats = self.engine.stats()  # so a caller sees its request queued at once
        _resolve(command.accepted, None)

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as exc:  # fail its requests, keep serving
            log.exception("the %s engine failed a step", self.name)
            self.error = exc
            self._fail_all(EngineFailure(f"the {self.name} engine failed: {exc}"))
            return
        self.step_seconds += time.perf_counter() - start
        self.steps += 1
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for out in outputs:
            consumer = self._consumers.get(out.request_id)
            if consumer is None:  # aborted by its consumer already
                continue
            if out.finished:
                del self._consumers[out.request_id]
            by_loop.setdefault(consumer.loop, []).append((consumer.outputs, out))
        for loop, items in by_loop.items():
            _deliver(loop, items)

    def _fail_all(self, exc: BaseException) -> None:
        """End every running request with ``exc`` (after aborting it in the engine)."""
        consumers = list(self._consumers.items())
        self._consumers.clear()
        for rid, _ in consumers:
            try:
                self.engine.abort(rid)
            except Exception:  # the engine may be broken; the clients still hear
                log.exception("abort of %s failed", rid)
        seen: set[int] = set()
        for _, consumer in consumers:
            if id(consumer) not in seen:
                seen.add(id(consumer))
                _deliver(consumer.loop, [(consumer.outputs, exc)])
        # refuse the adds still queued
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                _resolve(command.accepted, EngineStopped(f"the {self.name} engine stopped"))


def _deliver(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, Any]]) -> None:
    def put_all() -> None:
        for q, item in items:
            q.put_nowait(item)

    try:
        loop.call_soon_threadsafe(put_all)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass


def _resolve(future: asyncio.Future, exc: BaseException | None) -> None:
    def set_result() -> None:
        if future.done():
            return
        if exc is None:
            future.set_result(None)
        else:
            future.set_exception(exc)

    try:
        future.get_loop().call_soon_threadsafe(set_result)
    except RuntimeError:
        pass
