"""``megacpp eval humaneval-x --endpoint URL --model NAME``: sampling from real HTTP servers on
loopback (a real ``megacpp serve`` process, and scripted ``http.server`` servers that fail,
stall or misbehave on purpose), then the real sandboxed verifier and pass@k."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from megacpp.eval import load_problems
from megacpp.eval.harness import RECEIPT_FILE, SAMPLES_FILE, SUMMARY_FILE
from tests.eval.cli_helpers import error_line, run_eval
from tests.infer.server_helpers import save_checkpoint, serve_process, tiny_tokenizer

# (status, headers, body) for the request body and its number (0-based)
Answer = Callable[[dict, int], tuple[int, dict[str, str], bytes]]


def megacpp(capsys, *args: str) -> tuple[int, str, str]:
    """``megacpp eval humaneval-x ARGS`` in-process; returns (exit code, stdout, stderr)."""
    return run_eval(capsys, "humaneval-x", *args)


class ScriptedServer(ThreadingHTTPServer):
    """A real HTTP server on loopback whose answers come from ``answer``; it records every
    request body and the most requests it had in flight at once."""

    daemon_threads = True

    def __init__(self, answer: Answer, delay_s: float = 0.0) -> None:
        super().__init__(("127.0.0.1", 0), _ScriptedHandler)
        self.answer, self.delay_s = answer, delay_s
        self.bodies: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request, client_address) -> None:
        pass  # a client that gave up (the timeout test) breaks the pipe: expected here


class _ScriptedHandler(BaseHTTPRequestHandler):
    server: ScriptedServer

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        with self.server.lock:
            number = len(self.server.bodies)
            self.server.bodies.append({**body, "path": self.path,
                                       "auth": self.headers.get("authorization")})
            self.server.in_flight += 1
            self.server.max_in_flight = max(self.server.max_in_flight, self.server.in_flight)
        try:
            time.sleep(self.server.delay_s)
            status, headers, content = self.server.answer(body, number)
        finally:
            with self.server.lock:
                self.server.in_flight -= 1
        self.send_response(status)
        for name, value in {"content-type": "application/json", **headers}.items():
            self.send_header(name, value)
        self.send_header("content-length", str(len(content)))
        self.end_headers()
        self.wfile.write(content)

    def log_message(self, *args) -> None:
        pass


@contextmanager
def scripted(answer: Answer, delay_s: float = 0.0) -> Iterator[ScriptedServer]:
    server = ScriptedServer(answer, delay_s)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def reference_body(prompt: str) -> str:
    """What a model that writes the reference solution returns when it stops at ``"\\n}"``:
    the function body without its closing brace."""
    solution = {p.prompt: p.canonical_solution for p in load_problems()}[prompt]
    return solution[:solution.index("\n}")]


def openai_answer(body: dict, model: str = "served-model-v1") -> bytes:
    choices = [{"index": i, "text": reference_body(body["prompt"]), "logprobs": None,
                "finish_reason": "stop"} for i in range(body["n"])]
    return json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 0,
                       "model": model, "choices": choices}).encode()


# ---- a real `megacpp serve` -----------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("endpoint")
    save_checkpoint(tmp / "run", seed=0)
    tokenizer = tiny_tokenizer().save(tmp / "tokenizer.json")
    with serve_process("--checkpoint", f"tiny={tmp / 'run'}", "--tokenizer", str(tokenizer),
                       "--max-num-seqs", "4", "--max-model-len", "2048") as (url, _):
        yield url


def test_scores_a_real_megacpp_serve_and_records_the_endpoint(served, tmp_path, capsys):
    out = tmp_path / "eval"
    code, stdout, err = megacpp(capsys, "--endpoint", served, "--model", "tiny", "--out",
                                str(out), "--limit", "2", "--n", "2", "--temperature", "0",
                                "--max-new-tokens", "8", "--seed", "3", "--concurrency", "1",
                                "--workers", "1")
    assert code == 0, err
    assert "pass@1" in stdout and "sampling 2 completions for each of 2 problems" in stdout
    samples = [json.loads(line) for line in (out / SAMPLES_FILE).read_text().splitlines()]
    assert [(s["task_id"], s["sample"]) for s in samples] == [
        ("CPP/0", 0), ("CPP/0", 1), ("CPP/1", 0), ("CPP/1", 1)]
    # the completions are the server's own: the same request sent directly answers the same
    prompt = load_problems()[0].prompt
    direct = httpx.post(f"{served}/v1/completions", json={
        "model": "tiny", "prompt": prompt, "n": 2, "temperature": 0, "max_tokens": 8,
        "top_p": 0.95, "stop": ["\n}"], "seed": 3}, timeout=60).json()
    for sample, choice in zip(samples[:2], direct["choices"]):
        expected = choice["text"] + ("\n}\n" if choice["finish_reason"] == "stop" else "")
        assert sample["completion"] == expected
    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert sum(summary["status_counts"].values()) == 4
    assert summary["per_problem"] == {
        task: {"n": 2, "passed": sum(s["status"] == "passed" for s in samples
                                     if s["task_id"] == task)} for task in ("CPP/0", "CPP/1")}
    receipt = json.loads((out / RECEIPT_FILE).read_text())
    assert receipt["kind"] == "eval"
    config = receipt["config"]
    assert config["model"] == {"endpoint": f"{served}/v1/completions", "requested": "tiny",
                               "name": "tiny"}
    sampling = config["sampling"]
    assert (sampling["n"], sampling["temperature"], sampling["top_p"],
            sampling["max_new_tokens"], sampling["seed"]) == (2, 0.0, 0.95, 8, 3)
    assert sampling["stop"] == ["\n}"] and sampling["requests"] == 2
    assert sampling["retried"] == 0 and sampling["concurrency"] == 1
    assert receipt["metrics"]["pass@1"] == summary["pass_at_k"]["pass@1"]


def test_a_model_name_megacpp_serve_rejects_is_one_line(served, tmp_path, capsys):
    code, _, err = megacpp(capsys, "--endpoint", f"{served}/v1", "--model", "nope", "--out",
                           str(tmp_path), "--limit", "1", "--n", "1", "--max-new-tokens", "4")
    line = error_line(err)
    assert code == 2 and "does not serve model 'nope'" in line and "it serves: tiny" in line
    code, _, err = megacpp(capsys, "--endpoint", served, "--model", "tiny", "--out",
                           str(tmp_path), "--limit", "1", "--n", "17", "--max-new-tokens", "4")
    line = error_line(err)
    assert code == 2 and "HTTP 400" in line and "--n-per-request" in line
    assert not (tmp_path / RECEIPT_FILE).exists()


# ---- scripted servers: retries, concurrency, chunking, failures -----------------------------


def test_retries_bounded_concurrency_and_n_per_request(tmp_path, capsys):
    def answer(body: dict, number: int):
        if number == 0:  # the first request fails as an overloaded server does
            return 503, {"retry-after": "0"}, b'{"error": {"message": "overloaded"}}'
        return 200, {}, openai_answer(body)

    out = tmp_path / "eval"
    with scripted(answer, delay_s=0.2) as server:
        code, _, err = megacpp(capsys, "--endpoint", server.url, "--model", "alias",
                               "--api-key", "sk-test", "--out", str(out), "--limit", "2",
                               "--n", "2", "--n-per-request", "1", "--concurrency", "2",
                               "--seed", "10", "--max-new-tokens", "64", "--top-p", "0.5",
                               "--temperature", "0.2", "--retries", "2", "--workers", "1")
    assert code == 0, err
    assert len(server.bodies) == 5 and server.max_in_flight == 2
    assert {b["path"] for b in server.bodies} == {"/v1/completions"}
    assert {b["auth"] for b in server.bodies} == {"Bearer sk-test"}
    prompts = [p.prompt for p in load_problems()[:2]]
    sent = sorted((prompts.index(b["prompt"]), b["seed"]) for b in server.bodies[1:])
    assert sent == [(0, 10), (0, 11), (1, 10), (1, 11)]
    assert all((b["model"], b["n"], b["temperature"], b["top_p"], b["max_tokens"], b["stop"])
               == ("alias", 1, 0.2, 0.5, 64, ["\n}"]) for b in server.bodies)
    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert summary["pass_at_k"]["pass@1"] == 1.0 and summary["status_counts"] == {"passed": 4}
    receipt = json.loads((out / RECEIPT_FILE).read_text())
    assert receipt["config"]["model"] == {"endpoint": f"{server.url}/v1/completions",
                                          "requested": "alias", "name": "served-model-v1"}
    sampling = receipt["config"]["sampling"]
    assert (sampling["requests"], sampling["retried"], sampling["n_per_request"]) == (4, 1, 1)
    assert "sk-test" not in json.dumps(receipt)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _json(status: int, body: object, headers: dict[str, str] | None = None) -> Answer:
    return lambda _body, _number: (status, headers or {}, json.dumps(body).encode())


@pytest.mark.parametrize("answer, extra, code, needle", [
    (_json(503, {"error": {"message": "loading"}}), ("--retries", "1"), 1,
     "after 2 attempt(s); the last: HTTP 503 (loading)"),
    (lambda _b, _n: (200, {}, b"<html>gateway</html>"), (), 1,
     "answered CPP/0 with a body that is not JSON: '<html>gateway</html>'"),
    (_json(200, {"object": "text_completion"}), (), 1,
     "malformed completion response: no 'choices' list"),
    (_json(200, {"choices": [{"index": 0, "text": "x"}]}), ("--n", "2"), 1,
     "1 choice(s) for n=2 (for a server that caps or ignores n, pass --n-per-request)"),
    (_json(200, {"choices": [{"index": 0, "text": 7}]}), (), 1, "without a string 'text'"),
    (_json(404, {"detail": "Not Found"}), (), 2,
     "HTTP 404 (Not Found): is --endpoint the server's base URL"),
    (_json(404, {"error": {"message": "The model `m` does not exist.", "type": "NotFoundError",
                           "param": None, "code": 404}}), (), 2, "does not serve model 'm'"),
    (_json(401, {"error": {"message": "bad key"}}), (), 2, "--api-key"),
    (lambda _b, _n: (200, {}, b" " * ((64 << 20) + 1)), (), 1,
     "sent a response of more than 64 MiB; refusing to read it"),
], ids=["503-every-time", "not-json", "no-choices", "too-few-choices", "text-not-a-string",
        "no-such-route", "unknown-model", "bad-key", "huge-body"])
def test_a_failing_or_misbehaving_server_is_one_line(answer, extra, code, needle, tmp_path,
                                                      capsys):
    with scripted(answer) as server:
        got, _, err = megacpp(capsys, "--endpoint", server.url, "--model", "m", "--out",
                              str(tmp_path / "eval"), "--limit", "1", "--n", "1",
                              "--workers", "1", *extra)
    line = error_line(err)
    assert got == code and needle in line, line
    assert server.url in line
    assert not (tmp_path / "eval").exists()


def test_an_unreachable_or_stalled_server_is_one_line(tmp_path, capsys):
    port = _closed_port()
    code, _, err = megacpp(capsys, "--endpoint", f"http://127.0.0.1:{port}", "--model", "m",
                           "--out", str(tmp_path), "--limit", "1", "--retries", "1")
    line = error_line(err)
    assert code == 1 and "after 2 attempt(s); the last: ConnectError" in line, line
    assert "ConnectionRefusedError" in line
    with scripted(lambda body, _n: (200, {}, openai_answer(body)), delay_s=3) as server:
        started = time.monotonic()
        code, _, err = megacpp(capsys, "--endpoint", server.url, "--model", "m", "--out",
                               str(tmp_path), "--limit", "1", "--n", "1",
                               "--request-timeout", "0.3", "--retries", "0")
        assert time.monotonic() - started < 3
    line = error_line(err)
    assert code == 1 and "the last: no response within 0.3 s" in line, line


@pytest.mark.parametrize("args, needle", [
    (("--endpoint", "ftp://host/v1", "--model", "m"), "expected an http:// or https:// URL"),
    (("--endpoint", "http://", "--model", "m"), "--endpoint 'http://'"),
    (("--endpoint", "http://h:8000/v1/chat/completions", "--model", "m"), "is a chat route"),
    (("--endpoint", "http://h:8000/v1"), "--endpoint URL and --model NAME go together"),
    (("--model", "m"), "--endpoint URL and --model NAME go together"),
    (("--endpoint", "http://h/v1", "--model", "m", "--checkpoint", "run"), "for a local model"),
    (("--endpoint", "http://h/v1", "--model", "m", "--concurrency", "0"), "--concurrency 0"),
    (("--endpoint", "http://h/v1", "--model", "m", "--retries", "-1"), "--retries -1"),
    (("--endpoint", "http://h/v1", "--model", "m", "--request-timeout", "nan"),
     "--request-timeout nan"),
    (("--endpoint", "http://h/v1", "--model", "m", "--n-per-request", "0"), "--n-per-request 0"),
    ((), "give --checkpoint DIR (a local model) or --endpoint URL --model NAME"),
])
def test_endpoint_misuse_is_one_line_and_exit_2(args, needle, tmp_path, capsys):
    code, _, err = megacpp(capsys, "--out", str(tmp_path / "eval"), *args)
    assert code == 2 and needle in error_line(err)


def test_the_completions_url_is_found_from_a_base_url():
    from megacpp.eval.endpoint import Endpoint, completions_url

    for given in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/",
                  "http://h:8000/v1/completions"):
        assert completions_url(given) == "http://h:8000/v1/completions"
    assert completions_url("https://gw/openai") == "https://gw/openai/v1/completions"
    url = completions_url("http://user:secret@h:8000/v1")
    assert Endpoint(url, "m").public_url() == "http://h:8000/v1/completions"

