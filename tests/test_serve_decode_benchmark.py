"""benchmarks/serve_decode.py on a CPU at tiny sizes: the engine, the dynamic-cache peer and
the static-cache peer (generate's own compile, dynamo's eager backend here) each give a row
per batch size, the static peer compiles nothing inside its timed runs, and ``--profile``
writes its summary."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megacpp.data.tokenizer import CppTokenizer, train_tokenizer
from megacpp.receipts import read_receipt

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "serve_decode.py"
HEADERS = sorted(Path("/usr/include/c++/12/bits").glob("stl_*.h"))[:4]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> Path:
    if not HEADERS:
        pytest.skip("needs the libstdc++ headers in /usr/include/c++/12")
    tok = CppTokenizer.from_hf(train_tokenizer([p.read_text() for p in HEADERS], vocab_size=600))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(path)
    return path


def _run(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), "--preset", "tiny", "--device", "cpu",
           "--dtype", "float32", "--prompt-len", "8", "--block-size", "4", *args]
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
           "HOME": str(Path.home())}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=False)


@pytest.mark.slow
def test_engine_and_both_peers_on_cpu(tokenizer_json: Path, tmp_path: Path):
    out = tmp_path / "out"
    done = _run("--tokenizer", str(tokenizer_json), "--batch", "1", "2", "--new-tokens", "3",
                "--systems", "engine", "hf", "hf-static", "--hf-compile-backend", "eager",
                "--hf-compile-mode", "none", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "serve_decode.json").read_text())
    rows = {(r["system"], r["batch"]): r for r in result["results"]}
    assert set(rows) == {(s, b) for s in ("engine", "hf", "hf-static") for b in (1, 2)}
    for (system, batch), row in rows.items():
        assert row["error"] is None, (system, batch, row["error"])
        assert row["ttft_ms_p50"] > 0 and row["itl_ms_p50"] > 0 and row["decode_tok_s"] > 0
    # the static peer's compile happens in its warm-up runs, none inside the timed ones
    assert all(rows["hf-static", b]["graphs_compiled_in_run"] == 0 for b in (1, 2))
    assert rows["hf", 1]["model"] == rows["hf-static", 1]["model"]  # the same Llama
    assert set(result["engine_over_hf_static"]) == {"1", "2"}
    assert {"ttft_ms_p50", "itl_ms_p50"} <= set(result["engine_over_hf_static"]["1"])
    receipt = read_receipt(out / "receipts" / "serve_decode" / "hf-static_B2.json")
    assert receipt.config["system"] == "hf-static"


@pytest.mark.slow
def test_profile_mode_writes_the_decode_step_summary(tokenizer_json: Path, tmp_path: Path):
    out = tmp_path / "prof"
    done = _run("--tokenizer", str(tokenizer_json), "--batch", "2", "--profile",
                "--profile-steps", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "profile_B2.json").read_text())
    assert result["batch"] == 2 and result["served"]["step_ms"] > 0
    assert set(result["eager_by_family_ms_per_step"]) == {"A", "E", "M", "R"}  # tiny: AEMEAEMR
    counted = result["bytes"]
    assert counted["weights_read_per_step"] <= counted["weights_bytes"]
    assert counted["weights_read_per_token"] == counted["weights_read_per_step"] / 2
    assert "decode profile  B=2" in (out / "profile_B2.txt").read_text()
    prefill = result["prefill"]  # one step prefills both prompts, as served and eagerly
    assert prefill["graphs"] is False  # on a CPU the engine prefills eagerly
    assert prefill["served"]["step_ms"] > 0 and prefill["eager"]["step_ms"] > 0
    assert set(prefill["eager"]["by_family_ms"]) == {"A", "E", "M", "R"}  # the prefill's split
    assert prefill["served"]["top_kernels"] == []  # device kernels only: none on a CPU
    assert "prefill served:" in (out / "profile_B2.txt").read_text()
