"""Shared by the server, router and ``megacpp serve`` tests: a real tokenizer, real tiny
models behind the real Engine, a real uvicorn server on loopback, and a real checkpoint.

(Imported as ``tests.infer.server_helpers``: pyproject puts the repo root on pytest's path.)
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import torch

from megacpp.data.tokenizer import CppTokenizer, train_tokenizer
from megacpp.infer.async_engine import AsyncEngine
from megacpp.infer.engine import Engine, EngineConfig
from megacpp.infer.router import SnippetClassifier
from megacpp.model.config import load_config
from megacpp.model.model import HybridLM

if TYPE_CHECKING:  # the server modules need fastapi: imported only where a server runs
    from megacpp.infer.jobs import Specialist

BITS = Path("/usr/include/c++/12/bits")
# Real C++ for the tokenizer (libstdc++ headers when present, else this file's own snippets).
FALLBACK_CPP = """
#include <vector>
template <typename T> struct Box { T value; Box(T v) : value(v) {} };
int main() { std::vector<int> xs{1, 2, 3}; for (int x : xs) { return x; } return 0; }
"""


@cache
def tiny_tokenizer() -> CppTokenizer:
    """A 600-token C++ tokenizer trained on a few real headers (~0.2 s)."""
    texts = [p.read_text(encoding="utf-8") for p in sorted(BITS.glob("stl_*.h"))[:6]]
    return CppTokenizer.from_hf(train_tokenizer(texts or [FALLBACK_CPP * 50], vocab_size=600))


def tiny_model(vocab_size: int, seed: int = 0) -> HybridLM:
    """The ``tiny`` preset (A E M R families), random init, at the tokenizer's vocabulary."""
    torch.manual_seed(seed)
    cfg = dataclasses.replace(load_config("tiny"), vocab_size=vocab_size)
    return HybridLM(cfg).eval()


def tiny_specialist(name: str, seed: int = 0, **config) -> Specialist:
    from megacpp.infer.jobs import Specialist

    tok = tiny_tokenizer()
    cfg = EngineConfig(**{"max_num_seqs": 8, "max_model_len": 256, **config})
    engine = Engine(tiny_model(tok.vocab_size, seed), tok, cfg)
    return Specialist(name, AsyncEngine(engine, name), tok, cfg.max_model_len)


@dataclasses.dataclass
class LiveServer:
    url: str
    specialists: dict[str, Specialist]

    def stats(self, name: str | None = None):
        spec = self.specialists[name or next(iter(self.specialists))]
        return spec.engine.stats  # the snapshot the engine thread refreshes every round

    def wait_idle(self, name: str | None = None, timeout: float = 10.0):
        """The engine's stats once nothing runs or waits and every block and slot is free."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats(name)
            if (s.running == s.waiting == 0 and s.free_blocks == s.total_blocks
                    and s.free_slots == s.total_slots):
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout}s: {s}")
            time.sleep(0.02)


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextmanager
def live_server(specialists: list[Specialist],
                classifier: SnippetClassifier | None = None) -> Iterator[LiveServer]:
    """A real uvicorn server on a random loopback port, in a thread, with the real app."""
    import uvicorn

    from megacpp.infer.server import create_app

    app = create_app(specialists, classifier)
    sock = free_socket()
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5,
                            lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield LiveServer(f"http://127.0.0.1:{sock.getsockname()[1]}",
                         {s.name: s for s in specialists})
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


# ---- a real checkpoint for `megacpp serve` ----------------------------------------------------


def save_checkpoint(run_dir: Path, seed: int = 0) -> Path:
    """Write a random-init tiny model as a real (verified) checkpoint of ``run_dir``."""
    from megacpp.train.checkpoint import CheckpointManager
    from megacpp.train.parallelize import DistEnv

    model = tiny_model(tiny_tokenizer().vocab_size, seed)
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"),
                  strategy="single")
    state = {"step": 1, "model_config": model.cfg.to_dict(), "world_size": 1}
    return CheckpointManager(run_dir, keep_last=1, env=env).save(1, model, [], state, {})


def serve_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "400"}


@contextmanager
def serve_process(*args: str, timeout: float = 60) -> Iterator[tuple[str, subprocess.Popen]]:
    """``megacpp serve ARGS --port 0`` in a subprocess; yields (base url, process) once it
    answers /health, and stops it with SIGINT afterwards."""
    proc = subprocess.Popen([sys.executable, "-m", "megacpp", "serve", *args, "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=serve_env())
    try:
        url = _read_url(proc, timeout)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"megacpp serve did not become healthy:\n{proc.stderr.read()}")
            time.sleep(0.1)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(2)  # SIGINT: a clean shutdown
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _read_url(proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if m := re.search(r"(http://127\.0\.0\.1:\d+)", line):
            return m.group(1)
    proc.kill()
    raise AssertionError(f"megacpp serve printed no URL:\n{''.join(lines)}\n{proc.stderr.read()}")


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")
