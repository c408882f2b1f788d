"""lm-evaluation-harness against a real ``megacpp serve`` on loopback: ``lm-eval --model
local-completions`` runs a loglikelihood task (multiple choice, scored through ``echo`` and
``logprobs``) and a generation task (exact match), both on local data under
``tests/infer/data/lm_eval`` (``dataset_path: json``, offline). Its tokenizer is the served
model's, exported as Hugging Face files (no hub). One loglikelihood it reports is checked
against a plain forward of the served checkpoint, and one generation against the server's
own completion."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from megacpp.export.hf_format import write_tokenizer
from megacpp.pretrained import load_pretrained
from tests.infer.server_helpers import save_checkpoint, serve_process, tiny_tokenizer

DATA = Path(__file__).parent / "data" / "lm_eval"
TASKS = ("megacpp_cpp_choice", "megacpp_cpp_complete")

pytestmark = pytest.mark.slow  # ~40 s: the server, then lm-eval's imports on a small CPU


def lm_eval_env(home: Path) -> dict[str, str]:
    """Offline: datasets and the hub read only local files; caches under ``home``."""
    return {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1", "OPENAI_API_KEY": "unused"}


def test_lm_eval_local_completions_scores_both_tasks(tmp_path):
    save_checkpoint(tmp_path / "run", seed=0)
    tokenizer = tiny_tokenizer().save(tmp_path / "tokenizer.json")
    write_tokenizer(tiny_tokenizer(), tmp_path / "hf_tokenizer")
    tasks = tmp_path / "tasks"  # the task files, and the working directory data_files are in
    shutil.copytree(DATA, tasks)
    out = tmp_path / "results"
    with serve_process("--checkpoint", f"tiny={tmp_path / 'run'}", "--tokenizer", str(tokenizer),
                       "--max-num-seqs", "4", "--max-model-len", "512") as (url, _):
        model_args = (f"model=tiny,base_url={url}/v1/completions,tokenizer_backend=huggingface,"
                      f"tokenizer={tmp_path / 'hf_tokenizer'},add_bos_token=True,"
                      "max_length=512,num_concurrent=1,max_retries=1")
        proc = subprocess.run(
            [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
             model_args, "--tasks", ",".join(TASKS), "--include_path", str(tasks),
             "--output_path", str(out), "--log_samples"],
            cwd=tasks, env=lm_eval_env(tmp_path / "hf_home"), capture_output=True, text=True,
            check=False, timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        (results_file,) = out.glob("tiny/results_*.json")
        results = json.loads(results_file.read_text())["results"]
        choice, complete = (results[t] for t in TASKS)
        assert 0 <= choice["acc,none"] <= 1 and choice["sample_len"] == 4
        assert 0 <= complete["exact_match,none"] <= 1 and complete["sample_len"] == 3
        generated = first_sample(out, "megacpp_cpp_complete")
        direct = httpx.post(f"{url}/v1/completions", json={
            "model": "tiny", "prompt": generated["arguments"]["gen_args_0"]["arg_0"],
            "max_tokens": 8, "temperature": 0, "stop": ["\n"]}, timeout=60).json()
        assert generated["resps"][0][0] == direct["choices"][0]["text"]

    # the first choice's loglikelihood: the checkpoint's own forward over the same tokens
    scored = first_sample(out, "megacpp_cpp_choice")
    args = scored["arguments"]["gen_args_0"]
    reported = float(scored["resps"][0][0][0])
    tok = tiny_tokenizer()
    context = [tok.bos_id, *tok.encode(args["arg_0"]).tolist()]
    whole = [tok.bos_id, *tok.encode(args["arg_0"] + args["arg_1"]).tolist()]
    assert whole[:len(context)] == context and len(whole) > len(context)
    model = load_pretrained(tmp_path / "run", "cpu", tokenizer=tokenizer).model
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), dim=-1)
    expected = sum(logp[t - 1, whole[t]].item() for t in range(len(context), len(whole)))
    assert reported == pytest.approx(expected, abs=1e-3)


def first_sample(out: Path, task: str) -> dict:
    (samples,) = out.glob(f"tiny/samples_{task}_*.jsonl")
    return json.loads(samples.read_text().splitlines()[0])
