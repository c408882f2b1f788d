"""The Python API: the docs' example runs as written, imports stay lazy, config_from_pattern
validates, and load_pretrained's hook for Hugging Face export directories."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

import megacpp
from megacpp.errors import ConfigError, MegaCppError
from megacpp.train.config import RunConfig
from megacpp.train.trainer import train
from tests.train.helpers import run_config, single_thread_env

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def _doc_example() -> str:
    text = API_DOC.read_text(encoding="utf-8")
    match = re.search(r"<!-- api-example:[^\n]*-->\n```python\n(.*?)```", text, re.DOTALL)
    assert match, "docs/api.md lost its api-example block"
    return match.group(1)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, cpp_dataset) -> Path:
    """A directory holding runs/tiny-cpu: a real (2-step) training run."""
    root = tmp_path_factory.mktemp("api")
    cfg = RunConfig.from_dict(run_config(cpp_dataset, root / "runs" / "tiny-cpu",
                                         train={"steps": 2, "eval_every": 2},
                                         checkpoint={"every": 2, "keep_last": 1}))
    train(cfg, console=Console(quiet=True))
    return root


def test_the_docs_example_runs_as_written(workdir):
    code = _doc_example()
    assert len(code.strip().splitlines()) == 5
    out = subprocess.run([sys.executable, "-c", code], cwd=workdir, capture_output=True,
                         text=True, env=single_thread_env(), timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    params, completion = out.stdout.split("\n", 1)
    assert re.fullmatch(r"[\d,]+ parameters", params)
    assert completion.strip()  # 64 sampled tokens of a (barely) trained model


def test_generation_is_seeded_and_greedy_at_temperature_zero(workdir):
    lm = megacpp.load_pretrained(workdir / "runs" / "tiny-cpu")
    prompt = "int f(int x) {"
    assert lm.generate(prompt, max_new_tokens=12, seed=4) == lm.generate(
        prompt, max_new_tokens=12, seed=4)
    greedy = megacpp.generate(lm.model, lm.tokenizer, prompt, max_new_tokens=12, temperature=0)
    ids = [lm.tokenizer.bos_id, *lm.tokenizer.encode(prompt).tolist()]
    import torch

    out = lm.model.generate_greedy(torch.tensor([ids]), max_new_tokens=12)[0, len(ids):].tolist()
    if lm.tokenizer.eos_id in out:
        out = out[: out.index(lm.tokenizer.eos_id)]
    assert greedy == lm.tokenizer.decode(out)
    with pytest.raises(MegaCppError, match="top_p must be in"):
        lm.generate(prompt, top_p=0)


def test_import_is_lazy():
    code = ("import sys, megacpp; assert 'torch' not in sys.modules, 'import megacpp'; "
            "megacpp.__version__; megacpp.config_from_pattern; megacpp.ConfigError; "
            "print('torch' in sys.modules); megacpp.HybridLM; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=single_thread_env(), check=True).stdout.split()
    assert out == ["False", "True"]
    assert "HybridLM" in dir(megacpp) and "load_pretrained" in megacpp.__all__
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        megacpp.nope  # noqa: B018


def test_config_from_pattern_validates():
    cfg = megacpp.config_from_pattern("A:mla E M R", d_model=64, attention={"n_heads": 4},
                                      vocab_size=1000)
    assert cfg.pattern == "A:mla E M R" and cfg.d_model == 64 and cfg.attention.n_heads == 4
    assert cfg.vocab_size == 1000 and cfg.mamba == megacpp.load_config("tiny").mamba
    assert megacpp.HybridLM(cfg).cfg == cfg
    for kwargs, needle in [
        ({"pattern": "AXQ"}, "pattern 'AXQ' is invalid: unknown layer letter 'X'"),
        ({"pattern": "AE", "d_model": 0}, "model.d_model = 0 is invalid"),
        ({"pattern": "AE", "atention": {"n_heads": 2}}, "unknown config table(s) ['atention']"),
        ({"pattern": "AE", "dmodel": 3}, "unknown key(s) ['dmodel'] in [model]"),
        ({"pattern": "AE", "preset": "nope"}, "unknown preset 'nope'"),
    ]:
        with pytest.raises(ConfigError) as err:
            megacpp.config_from_pattern(**kwargs)
        assert needle in str(err.value)


# -- Hugging Face exports -------------------------------------------------------------------
def _export_dir(root: Path, model_type: str = "megacpp") -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": model_type}))
    return root


def test_an_hf_config_of_another_model_is_refused(tmp_path):
    with pytest.raises(MegaCppError, match="model_type 'llama'; only megacpp exports"):
        megacpp.load_pretrained(_export_dir(tmp_path / "llama", "llama"))


def test_an_hf_export_loads_like_its_run(workdir, tmp_path):
    """``megacpp export hf`` of the run, then load_pretrained of the export: same samples."""
    from megacpp.export.hf import export_run

    run = workdir / "runs" / "tiny-cpu"
    export = export_run(run, tmp_path / "export")
    lm = megacpp.load_pretrained(export)
    assert lm.source == export and not lm.model.training
    assert lm.generate("int x", max_new_tokens=5, seed=0) == megacpp.load_pretrained(
        run).generate("int x", max_new_tokens=5, seed=0)
