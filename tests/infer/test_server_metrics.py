"""/metrics of a real server on loopback: every metric family by its exact name, with its type
and label names, before any request (families without samples) and after completions, chat
and a refused body; the values count what was sent."""

from __future__ import annotations

import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.infer.server_helpers import live_server, tiny_specialist

pytestmark = pytest.mark.usefixtures("one_thread")

# name as written on the "# TYPE" line -> (type, label names of its samples; "le" aside)
FAMILIES = {
    "megacpp_requests_total": ("counter", {"endpoint", "model", "code"}),
    "megacpp_route_total": ("counter", {"model", "how"}),
    "megacpp_prompt_tokens_total": ("counter", {"model"}),
    "megacpp_generation_tokens_total": ("counter", {"model"}),
    "megacpp_engine_running": ("gauge", {"model"}),
    "megacpp_engine_waiting": ("gauge", {"model"}),
    "megacpp_engine_free_blocks": ("gauge", {"model"}),
    "megacpp_engine_total_blocks": ("gauge", {"model"}),
    "megacpp_engine_free_slots": ("gauge", {"model"}),
    "megacpp_engine_total_slots": ("gauge", {"model"}),
    "megacpp_engine_preemptions_total": ("counter", {"model"}),
    "megacpp_engine_spec_draft_tokens_total": ("counter", {"model"}),
    "megacpp_engine_spec_accepted_tokens_total": ("counter", {"model"}),
    "megacpp_engine_steps_total": ("counter", {"model"}),
    "megacpp_engine_step_seconds_total": ("counter", {"model"}),
    "megacpp_engine_up": ("gauge", {"model"}),
    "megacpp_engine_prefix_cache_hit_rate": ("gauge", {"model"}),
    "megacpp_engine_prefix_cached_blocks": ("gauge", {"model"}),
    "megacpp_engine_prefix_snapshots": ("gauge", {"model"}),
    "megacpp_engine_prefix_cache_queries_total": ("counter", {"model"}),
    "megacpp_engine_prefix_cache_hits_total": ("counter", {"model"}),
    "megacpp_engine_prefix_cache_evictions_total": ("counter", {"model"}),
    "megacpp_request_duration_seconds": ("histogram", {"endpoint"}),
    "megacpp_time_to_first_token_seconds": ("histogram", {"model"}),
    "megacpp_inter_token_latency_seconds": ("histogram", {"model"}),
}
HISTOGRAM_SUFFIXES = {"_bucket", "_sum", "_count"}


def scrape(url: str) -> tuple[dict[str, str], list]:
    """The "# TYPE" lines as {name: type}, and every sample (via prometheus_client's parser)."""
    response = httpx.get(f"{url}/metrics", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = response.text
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.MULTILINE))
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    return types, samples


def check_families(types: dict[str, str], samples: list) -> None:
    assert types == {name: kind for name, (kind, _) in FAMILIES.items()}
    for sample in samples:
        name, suffix = sample.name, ""
        if name not in FAMILIES:
            base, suffix = re.fullmatch(r"(.*)(_bucket|_sum|_count)", name).groups()
            assert FAMILIES[base][0] == "histogram", name
            name = base
        labels = set(sample.labels)
        if suffix == "_bucket":
            labels.remove("le")
        assert labels == FAMILIES[name][1], (sample.name, sample.labels)


def by_labels(samples: list, name: str) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value for s in samples if s.name == name}


def test_metric_names_types_and_labels_before_and_after_requests():
    with live_server([tiny_specialist("tiny")]) as srv:
        types, samples = scrape(srv.url)
        check_families(types, samples)
        assert by_labels(samples, "megacpp_engine_up") == {(("model", "tiny"),): 1}
        assert by_labels(samples, "megacpp_requests_total") == {}

        body = {"model": "tiny", "prompt": "int main() {", "max_tokens": 4, "temperature": 0,
                "ignore_eos": True}
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        with httpx.stream("POST", f"{srv.url}/v1/chat/completions", timeout=60, json={
                "model": "tiny", "messages": [{"role": "user", "content": "sum a vector"}],
                "max_tokens": 3, "ignore_eos": True, "stream": True}) as s:
            lines = [line for line in s.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        bad = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": 5},
                         timeout=30)
        assert bad.status_code == 400

        types, samples = scrape(srv.url)
        check_families(types, samples)
        tiny = (("model", "tiny"),)
        assert by_labels(samples, "megacpp_requests_total") == {
            (("code", "200"), ("endpoint", "completions"), ("model", "tiny")): 1,
            (("code", "200"), ("endpoint", "chat"), ("model", "tiny")): 1,
            (("code", "400"), ("endpoint", "completions"), ("model", "")): 1,
        }
        assert by_labels(samples, "megacpp_route_total") == {(("how", "model"), *tiny): 2}
        assert by_labels(samples, "megacpp_generation_tokens_total") == {tiny: 7}
        usage = r.json()["usage"]["prompt_tokens"]
        assert by_labels(samples, "megacpp_prompt_tokens_total")[tiny] > usage
        durations = by_labels(samples, "megacpp_request_duration_seconds_count")
        assert durations == {(("endpoint", "completions"),): 1, (("endpoint", "chat"),): 1}
        buckets = by_labels(samples, "megacpp_request_duration_seconds_bucket")
        assert buckets[(("endpoint", "chat"), ("le", "+Inf"))] == 1
        assert by_labels(samples, "megacpp_time_to_first_token_seconds_count") == {tiny: 2}
        assert by_labels(samples, "megacpp_inter_token_latency_seconds_count") == {tiny: 5}
        assert by_labels(samples, "megacpp_engine_steps_total")[tiny] >= 4
        assert by_labels(samples, "megacpp_engine_step_seconds_total")[tiny] > 0
        srv.wait_idle()
        samples = scrape(srv.url)[1]
        gauges = by_labels(samples, "megacpp_engine_free_blocks")
        assert gauges[tiny] == srv.stats().total_blocks > 0
        # every prompt token was looked up in the prefix cache once
        assert by_labels(samples, "megacpp_engine_prefix_cache_queries_total")[tiny] == \
            by_labels(samples, "megacpp_prompt_tokens_total")[tiny]
