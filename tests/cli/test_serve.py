"""``megacpp serve`` and ``megacpp serve router-train`` as a user runs them: real checkpoints,
a real server process on loopback, the official ``openai`` client, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from megacpp.cli.main import main
from tests.infer.server_helpers import save_checkpoint, serve_process, tiny_tokenizer

TEMPLATES = "template <typename _Tp>\nstruct _Box { _Tp _M_value; };\n"
CAPI = "int ssl_read(SSL *s, void *buf, int num);\nvoid SSL_free(SSL *s);\n"


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("serve")
    for name, seed in (("lib", 0), ("capi", 1)):
        save_checkpoint(tmp / name, seed)
    for name, text in (("lib_src", TEMPLATES), ("capi_src", CAPI)):
        (tmp / name).mkdir()
        for i in range(20):
            (tmp / name / f"f{i}.h").write_text(text * (3 + i % 4))
    return {"tmp": tmp, "lib": tmp / "lib", "capi": tmp / "capi",
            "tok": tiny_tokenizer().save(tmp / "tokenizer.json")}


def test_router_train_then_serve_two_specialists(setup, capsys):
    tmp = setup["tmp"]
    with pytest.raises(SystemExit) as done:  # in-process: click exits 0 at the end
        main(["serve", "router-train", "--source", f"lib={tmp / 'lib_src'}",
              "--source", f"capi={tmp / 'capi_src'}", "--out", str(tmp / "router.json"),
              "--snippet-lines", "4"])
    assert done.value.code == 0 and "held-out accuracy" in capsys.readouterr().out
    args = ("--checkpoint", f"lib={setup['lib']}",
            "--checkpoint", f"capi={setup['capi'] / 'checkpoints' / 'step_000001'}",
            "--tokenizer", str(setup["tok"]), "--router", str(tmp / "router.json"),
            "--max-num-seqs", "4", "--max-model-len", "256", "--no-prefix-cache")
    with serve_process(*args) as (url, proc):
        models = httpx.get(f"{url}/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["lib", "capi", "auto"]
        assert models[1]["checkpoint"].endswith("step_000001")
        oa = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        auto = oa.completions.with_raw_response.create(
            model="auto", prompt="void SSL_free(SSL *s);\nint ssl_read(", max_tokens=4)
        assert auto.headers["x-megacpp-specialist"] == "capi"
        assert auto.parse().model == "capi" and auto.parse().usage.completion_tokens <= 4
        chat = oa.chat.completions.create(model="lib", max_tokens=3, messages=[
            {"role": "user", "content": "Write a template."}])
        assert chat.model == "lib" and chat.choices[0].message.role == "assistant"
        stream = oa.chat.completions.create(model="auto", max_tokens=3, stream=True, messages=[
            {"role": "user", "content": TEMPLATES}])
        assert {chunk.model for chunk in stream} == {"lib"}
    assert proc.returncode == 0  # SIGINT: a clean shutdown
    assert "Application shutdown complete" in proc.stderr.read()


def cli_error(capsys, *args: str) -> str:
    """Run ``megacpp ARGS`` in-process; it must fail with exit code 2 and one clean line."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, (args, err)
    return err


def test_serve_bad_input_is_one_line(setup, tmp_path, capsys):
    lib, tok = str(setup["lib"]), str(setup["tok"])
    bad_router = tmp_path / "router.json"
    bad_router.write_text(json.dumps({"format": "megacpp-router-nb", "version": 1,
                                      "labels": ["x", "y"], "alpha": 1.0, "vocab": ["a"],
                                      "counts": [[1], [2]]}))
    for args, needle in [
        ((), "at least one --checkpoint"),
        (("--checkpoint", str(tmp_path / "missing")), "not found"),
        (("--checkpoint", lib, "--tokenizer", tok, "--dtype", "int8"), "--dtype"),
        (("--checkpoint", lib, "--tokenizer", tok, "--device", "tpu"), "--device"),
        (("--checkpoint", lib, "--tokenizer", tok, "--max-num-seqs", "0"), "max_num_seqs"),
        (("--checkpoint", lib, "--tokenizer", tok, "--prefix-snapshots", "0"), "prefix_snapshots"),
        (("--checkpoint", lib, "--tokenizer", tok, "--snapshot-interval", "-1"),
         "snapshot_interval"),
        (("--checkpoint", lib, "--checkpoint", lib, "--tokenizer", tok), "distinct"),
        (("--checkpoint", lib, "--tokenizer", tok, "--router", str(bad_router)),
         "not loaded specialists"),
        (("--checkpoint", "bad name=x"), "NAME=PATH"),
        (("--checkpoint", lib, "--port", "70000"), "--port"),
        (("--checkpoint", lib, "--tokenizer", tok, "--kernels", "turbo"), "--kernels"),
        (("--checkpoint", lib, "--tokenizer", tok, "--speculative-tokens", "2", "--port", "0"),
         "--speculative-tokens 2 needs a model with multi-token-prediction heads"),
        (("--checkpoint", lib, "--tokenizer", tok, "--speculative-tokens", "99"),
         "speculative_tokens must be an integer in 0..16"),
    ]:
        assert needle in cli_error(capsys, "serve", *args), args
    for args, needle in [
        (("--source", f"a={tmp_path}", "--out", str(tmp_path / "r.json")), "at least two"),
        (("--source", str(tmp_path), "--source", str(tmp_path), "--out", "r.json"), "NAME=PATH"),
        (("--source", f"a={tmp_path / 'none'}", "--source", f"b={tmp_path}", "--out", "r.json"),
         "does not exist"),
    ]:
        assert needle in cli_error(capsys, "serve", "router-train", *args), args
