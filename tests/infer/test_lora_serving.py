"""LoRA specialists in ``megacpp serve``: an adapter served over the base gives the merged
model's outputs (same weights, same greedy text), adapters load and unload while the server
runs, and bad adapters are refused with one message."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import torch

from megacpp.infer.adapters import AdapterError, AdapterSet
from megacpp.infer.async_engine import AsyncEngine
from megacpp.infer.engine import Engine, EngineConfig
from megacpp.infer.server import Specialist, create_app
from megacpp.posttrain.common import LoraOptions, Pair
from megacpp.posttrain.sft import SftConfig, run_sft
from megacpp.pretrained import load_pretrained
from tests.cli.test_cli_consistency import assert_one_error_line, run_cli
from tests.infer.server_helpers import free_socket, tiny_model, tiny_tokenizer

PROMPTS = ["template <typename T>\nstruct", "int main() {\n", "namespace std {\n"]
CONFIG = EngineConfig(max_num_seqs=4, max_model_len=128)


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """A 4-step LoRA SFT of the tiny serving model (also written as ``base/`` beside it): its
    adapter and its merged export."""
    from megacpp.export.hf import write_model_dir

    tok = tiny_tokenizer()
    root = tmp_path_factory.mktemp("lora")
    write_model_dir(tiny_model(tok.vocab_size), tok, root / "base", card="tiny\n")
    pairs = [Pair(p, " return 0;\n}\n") for p in PROMPTS]
    run_sft(tiny_model(tok.vocab_size), tok, pairs, root / "run",
            SftConfig(steps=4, batch_size=3, lr=5e-2, lora=LoraOptions(r=4)), base="tiny")
    return root / "run"


def base_set(runtime: bool = False) -> tuple[Specialist, AdapterSet]:
    tok = tiny_tokenizer()
    model = tiny_model(tok.vocab_size)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    spec = Specialist("base", AsyncEngine(Engine(model, tok, CONFIG), "base"), tok,
                      CONFIG.max_model_len)
    return spec, AdapterSet.of(spec, state, runtime)


def merged_specialist(run) -> Specialist:
    loaded = load_pretrained(run / "model")
    engine = Engine(loaded.model, loaded.tokenizer, CONFIG)
    return Specialist("merged", AsyncEngine(engine, "merged"), loaded.tokenizer,
                      CONFIG.max_model_len)


@contextmanager
def serving(specialists, adapters):
    import uvicorn

    app = create_app(specialists, None, adapters)
    sock = free_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}",
                          timeout=30) as client:
            yield client
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def greedy(client, model: str) -> list[str]:
    out = []
    for prompt in PROMPTS:
        r = client.post("/v1/completions", json={"model": model, "prompt": prompt,
                                                 "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


def test_an_adapter_serves_the_merged_models_weights_and_text(sft_run):
    base, adapters = base_set()
    spec = adapters.build("sft", sft_run / "adapters" / "step_000004")
    adapters.loaded["sft"] = "adapter"
    merged = merged_specialist(sft_run)
    served, export = spec.engine.engine.model.state_dict(), merged.engine.engine.model.state_dict()
    assert served.keys() == export.keys()
    assert all(torch.equal(served[k], export[k]) for k in served)
    base_weights = base.engine.engine.model.state_dict()
    assert any(not torch.equal(served[k], base_weights[k]) for k in served)
    with serving([base, spec, merged], adapters) as client:
        assert greedy(client, "sft") == greedy(client, "merged")
        models = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
        assert models["sft"]["parent"] == "base" and "parent" not in models["merged"]
        # without --runtime-lora the load route does not exist
        assert client.post("/v1/load_lora_adapter", json={"lora_name": "x",
                                                          "lora_path": "y"}).status_code == 404


def test_adapters_load_and_unload_at_run_time(sft_run, tmp_path):
    base, adapters = base_set(runtime=True)
    merged = merged_specialist(sft_run)
    adapter_dir = str(sft_run / "adapters" / "step_000004")
    with serving([base, merged], adapters) as client:
        assert client.post("/v1/completions", json={"model": "hot", "prompt": "int"}
                           ).status_code == 404
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "hot",
                                                       "lora_path": adapter_dir})
        assert r.status_code == 200, r.text
        assert r.json()["parent"] == "base" and r.json()["load_s"] > 0
        assert greedy(client, "hot") == greedy(client, "merged")
        again = client.post("/v1/load_lora_adapter", json={"lora_name": "hot",
                                                           "lora_path": adapter_dir})
        assert again.status_code == 400 and "already served" in again.json()["error"]["message"]
        bad = client.post("/v1/load_lora_adapter", json={"lora_name": "x",
                                                         "lora_path": str(tmp_path)})
        assert bad.status_code == 400 and "not a LoRA adapter directory" in bad.text
        r = client.post("/v1/unload_lora_adapter", json={"lora_name": "hot"})
        assert r.status_code == 200, r.text
        assert client.post("/v1/completions", json={"model": "hot", "prompt": "int"}
                           ).status_code == 404
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "base"}
                           ).status_code == 404
        assert greedy(client, "base")  # the base served throughout
        assert "hot" not in {m["id"] for m in client.get("/v1/models").json()["data"]}


def test_an_adapter_that_does_not_fit_the_base_is_refused(sft_run, tmp_path):
    import json
    import shutil

    _, adapters = base_set()
    wrong = tmp_path / "wrong"
    shutil.copytree(sft_run / "adapters" / "step_000004", wrong)
    config = json.loads((wrong / "adapter_config.json").read_text())
    config["target_modules"] = ["no_such_layer"]
    (wrong / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match="do not fit the base model"):
        adapters.build("w", wrong)
    config["target_modules"] = ["q_proj"]
    config["r"] = 2  # the weights are rank 4
    (wrong / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match="weights do not fit the base model"):
        adapters.build("w", wrong)


@pytest.mark.parametrize("lora,needle", [("plain", "expected NAME=DIR"),
                                         ("a=/no/such/dir", "not a LoRA adapter directory")])
def test_serve_lora_misuse_is_one_line(lora, needle, tmp_path):
    code, _, err = run_cli("serve", "--checkpoint", str(tmp_path), "--lora", lora)
    assert_one_error_line(code, err, ("serve", "--lora", lora))
    assert needle in err


@pytest.mark.slow
def test_megacpp_serve_lora_answers_as_the_merged_checkpoint(sft_run):
    from tests.infer.server_helpers import serve_process

    adapter = sft_run / "adapters" / "step_000004"
    args = ("--checkpoint", f"base={sft_run.parent / 'base'}", "--checkpoint",
            f"merged={sft_run / 'model'}", "--lora", f"sft={adapter}", "--device", "cpu",
            "--max-model-len", "128")
    with serve_process(*args) as (url, _), httpx.Client(base_url=url, timeout=30) as client:
        assert greedy(client, "sft") == greedy(client, "merged")
        assert greedy(client, "sft") != greedy(client, "base")


def test_the_router_adds_and_removes_specialists():
    import numpy as np

    from megacpp.errors import MegaCppError
    from megacpp.infer.router import Router, SnippetClassifier

    classifier = SnippetClassifier(["base", "sft"], ["int"], np.ones((2, 1)))
    router = Router(["base", "sft"], classifier)
    router.add("hot")
    assert router.route("hot", "int x;").name == "hot"
    for bad in ("hot", "auto", "a b", ""):
        with pytest.raises(MegaCppError):
            router.add(bad)
    for kept, needle in (("base", "default model"), ("sft", "label of the router model")):
        with pytest.raises(MegaCppError, match=needle):
            router.remove(kept)
    router.remove("hot")
    with pytest.raises(MegaCppError, match="not served here"):
        router.route("hot", "int x;")
