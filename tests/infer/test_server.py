"""The HTTP server on loopback with the real Engine (tiny preset, random init): httpx and the
official ``openai`` client, SSE, 400/404/429 errors, disconnects, /metrics."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from megacpp.infer.server import CHAT_STOP, ChatMessage, render_chat
from tests.infer.server_helpers import live_server, tiny_specialist

PROMPT = "template <typename T>\nint count(const T& xs) {\n"
LONG = {"max_tokens": 1000, "ignore_eos": True}  # seconds of decoding on the tiny model


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def srv():
    with live_server([tiny_specialist("tiny", max_model_len=1024)]) as server:
        yield server


@pytest.fixture(scope="module")
def client(srv):
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        yield c


def sse_events(response: httpx.Response) -> list:
    """The JSON payloads of an SSE response, checking the framing and the final [DONE]."""
    events, done = [], False
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: ") and not done, line
        if line == "data: [DONE]":
            done = True
        else:
            events.append(json.loads(line[len("data: "):]))
    assert done, "no data: [DONE]"
    return events


def metric_samples(client: httpx.Client) -> dict:
    """/metrics parsed by prometheus_client: {(name, labels as sorted tuple): value}."""
    text = client.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_completion_json_and_sse_agree_and_name_the_specialist(client):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.headers["x-megacpp-specialist"] == "tiny"
    assert r.headers["x-megacpp-route"] == "model"
    data = r.json()
    assert data["object"] == "text_completion" and data["model"] == "tiny"
    (choice,) = data["choices"]
    assert choice["finish_reason"] in {"stop", "length"} and choice["index"] == 0
    usage = data["usage"]
    assert 0 < usage["completion_tokens"] <= 12 and usage["prompt_tokens"] > 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=stream_body) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        assert s.headers["x-megacpp-specialist"] == "tiny"
        events = sse_events(s)
    *chunks, last = events
    assert last["choices"] == [] and last["usage"] == usage
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]  # greedy: same
    assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_n_seeds_stops_and_batched_prompts(client):
    body = {"model": "tiny", "prompt": [PROMPT, "int main() {"], "n": 2, "max_tokens": 6,
            "seed": 7, "temperature": 1.0}
    first = client.post("/v1/completions", json=body).json()
    again = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in first["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in first["choices"]] == [c["text"] for c in again["choices"]]
    # a stop sequence never appears in the text
    greedy = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT,
                                                   "max_tokens": 30, "temperature": 0}).json()
    text = greedy["choices"][0]["text"]
    assert len(text) >= 4
    stop = text[2:4]
    cut = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT,
                                               "max_tokens": 30, "temperature": 0,
                                               "stop": [stop]}).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == text[: text.find(stop)]
    # vLLM's stop_reason: the stop string that ended it; null when the length (or EOS) did
    assert cut["stop_reason"] == stop
    whole = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT,
                                                 "max_tokens": 3, "temperature": 0}).json()
    assert whole["choices"][0]["finish_reason"] == "length"
    assert whole["choices"][0]["stop_reason"] is None
    with client.stream("POST", "/v1/completions", json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": 30, "temperature": 0,
            "stop": [stop], "stream": True}) as response:
        streamed = sse_events(response)
    assert streamed[-1]["choices"][0]["stop_reason"] == stop
    assert all(c["choices"][0]["stop_reason"] is None for c in streamed[:-1])


def test_openai_client_completions_chat_stream_and_errors(srv):
    oa = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=30)
    assert [m.id for m in oa.models.list().data] == ["tiny"]
    c = oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    assert c.model == "tiny" and 0 < c.usage.completion_tokens <= 8
    streamed = oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                     stream=True)
    assert "".join(part.choices[0].text for part in streamed) == c.choices[0].text
    messages = [{"role": "system", "content": "You write C++."},
                {"role": "user", "content": "Sum a vector."}]
    chat = oa.chat.completions.create(model="tiny", messages=messages, max_tokens=6, seed=1,
                                      temperature=0)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason in {"stop", "length"}
    pieces = list(oa.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                             temperature=0, stream=True))
    assert pieces[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in pieces) == \
        chat.choices[0].message.content
    assert pieces[-1].choices[0].finish_reason == chat.choices[0].finish_reason
    with pytest.raises(openai.NotFoundError):
        oa.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        oa.completions.create(model="tiny", prompt="x", max_tokens=-3)


def test_chat_template_renders_comments_then_code():
    messages = [ChatMessage(role="system", content="Be terse."),
                ChatMessage(role="user", content="Write f.\nIt returns 1."),
                ChatMessage(role="assistant", content="int f() { return 1; }"),
                ChatMessage(role="user", content=[{"type": "text", "text": "Now g."}])]
    assert render_chat(messages) == ("// system: Be terse.\n// user: Write f.\n// It returns 1.\n"
                                     "int f() { return 1; }\n// user: Now g.\n")
    assert render_chat(messages[:3]).endswith("return 1; }")  # continues the assistant
    assert CHAT_STOP == "\n// user:"


@pytest.mark.parametrize(("body", "needle"), [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "invalid request"),
    ({"prompt": "x"}, "model"),
    ({"model": "tiny", "prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 5000}, "context"),
    ({"model": "tiny", "prompt": "x", "temperature": -0.5}, "temperature"),
    ({"model": "tiny", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "tiny", "prompt": "x", "n": 0}, "n"),
    ({"model": "tiny", "prompt": "x", "stop": 5}, "stop"),
    ({"model": "tiny", "prompt": "x", "stop": [""]}, "stop"),
    ({"model": "tiny", "prompt": "x", "stream": "yes"}, "stream"),
    ({"model": "tiny", "prompt": []}, "prompt"),
    ({"model": "tiny", "prompt": [1, 999999]}, "token ids"),
    ({"model": "tiny", "prompt": "x", "logprobs": 21}, "logprobs"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, "echo"),
    ({"model": "tiny", "prompt": "x", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"model": "tiny", "prompt": ["x"] * 300}, "queues at most"),
])
def test_invalid_completion_bodies_get_400_with_a_message(client, body, needle):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = client.post("/v1/completions", headers={"content-type": "application/json"}, **kwargs)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and needle in error["message"], error


@pytest.mark.parametrize(("body", "needle"), [
    ({"model": "tiny", "messages": []}, "messages"),
    ({"model": "tiny", "messages": [{"role": "tool", "content": "x"}]}, "role"),
    ({"model": "tiny", "messages": [{"role": "user", "content": 3}]}, "content"),
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "only text"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [{}]}, "tools"),
])
def test_invalid_chat_bodies_get_400(client, body, needle):
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_unknown_model_is_404_and_health_and_models(client):
    r = client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert client.get("/health").json() == {"status": "ok", "engines": {"tiny": "ok"}}
    (model,) = client.get("/v1/models").json()["data"]
    assert model["id"] == "tiny" and model["max_model_len"] == 1024


def _wait_for_metric(client, key, at_least, timeout=10.0):
    deadline = time.monotonic() + timeout
    while (value := metric_samples(client).get(key, 0)) < at_least:
        assert time.monotonic() < deadline, f"{key} stayed {value}"
        time.sleep(0.05)


def test_disconnect_cancels_the_sequence_and_frees_its_blocks(srv, client):
    before = srv.wait_idle()
    gone = ("megacpp_requests_total", (("code", "499"), ("endpoint", "completions"),
                                       ("model", "tiny")))
    n_gone = metric_samples(client).get(gone, 0)
    body = {"model": "tiny", "prompt": PROMPT, "stream": True, **LONG}
    with httpx.Client(base_url=srv.url, timeout=30) as c, \
            c.stream("POST", "/v1/completions", json=body) as s:  # dropped after 3 chunks
        lines = (line for line in s.iter_lines() if line)
        for _ in range(3):
            assert next(lines).startswith("data: {")
        assert srv.stats().running == 1
    _wait_for_metric(client, gone, n_gone + 1)
    after = srv.wait_idle()
    assert after.generated_tokens - before.generated_tokens < LONG["max_tokens"] // 2
    # a non-streaming request whose client times out (and closes the connection)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": PROMPT, **LONG},
                   timeout=httpx.Timeout(30, read=0.3))
    _wait_for_metric(client, gone, n_gone + 2)
    final = srv.wait_idle()
    assert final.generated_tokens - after.generated_tokens < LONG["max_tokens"] // 2


def test_full_queue_answers_429(client):
    # 8000 tokens: the running request must outlast the test on any CPU (it is aborted when
    # its stream is dropped, so the length costs nothing)
    with live_server([tiny_specialist("one", max_num_seqs=1, max_waiting=1,
                                      max_model_len=8192)]) as small, \
            httpx.Client(base_url=small.url, timeout=30) as c:
        body = {"model": "one", "prompt": PROMPT, "stream": True, "max_tokens": 8000,
                "ignore_eos": True}
        with c.stream("POST", "/v1/completions", json=body) as running:
            lines = running.iter_lines()  # kept: dropping it would close the connection
            next(lines)  # it is decoding: the one slot is taken
            with c.stream("POST", "/v1/completions", json=body) as waiting:
                assert waiting.status_code == 200 and small.stats().waiting == 1
                full = c.post("/v1/completions", json={**body, "stream": False})
                assert full.status_code == 429, full.text
                assert full.json()["error"]["code"] == "queue_full"
                oa = openai.OpenAI(base_url=f"{small.url}/v1", api_key="x", max_retries=0)
                with pytest.raises(openai.RateLimitError):
                    oa.completions.create(model="one", prompt="x", max_tokens=2)
        small.wait_idle()  # both streams were dropped: their sequences are gone
        codes = {dict(k[1]).get("code"): v for k, v in metric_samples(c).items()
                 if k[0] == "megacpp_requests_total"}
        assert codes["429"] == 2 and codes["499"] == 2


def test_metrics_parse_as_prometheus_text(client):
    client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3})
    text = client.get("/metrics")
    assert text.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(text.text)}
    for name, kind in [("megacpp_requests", "counter"), ("megacpp_engine_free_blocks", "gauge"),
                       ("megacpp_engine_waiting", "gauge"), ("megacpp_engine_running", "gauge"),
                       ("megacpp_engine_free_slots", "gauge"),
                       ("megacpp_engine_preemptions", "counter"),
                       ("megacpp_generation_tokens", "counter"),
                       ("megacpp_request_duration_seconds", "histogram"),
                       ("megacpp_time_to_first_token_seconds", "histogram"),
                       ("megacpp_inter_token_latency_seconds", "histogram")]:
        assert families[name].type == kind, name
    samples = metric_samples(client)
    label = (("model", "tiny"),)
    assert samples[("megacpp_engine_total_blocks", label)] > 0
    assert samples[("megacpp_generation_tokens_total", label)] >= 3
    assert samples[("megacpp_request_duration_seconds_count", (("endpoint", "completions"),))] > 0


def test_a_stopped_engine_is_503_and_unhealthy():
    with live_server([tiny_specialist("gone")]) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        srv.specialists["gone"].engine.stop()
        deadline = time.monotonic() + 10
        while srv.specialists["gone"].engine.running or \
                srv.specialists["gone"].engine._thread.is_alive():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        health = c.get("/health")
        assert health.status_code == 503 and health.json()["engines"]["gone"].startswith("down")
        r = c.post("/v1/completions", json={"model": "gone", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and "not running" in r.json()["error"]["message"]
