"""`megacpp export hf` on a real (tiny) trained run, through the CLI: transformers' greedy
generate() equals `megacpp generate --temperature 0`; the card comes from the receipt; bad
input is one error line."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from megacpp.cli.main import main
from megacpp.train.config import load_run_config
from megacpp.train.trainer import train
from tests.train.helpers import LIBSTDCXX, build_dataset, run_config, write_config

transformers = pytest.importorskip("transformers")

PROMPT = "template <typename T>\nT max_of(T a, T b) {\n"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    if not (LIBSTDCXX / "utility").is_file():
        pytest.skip(f"needs the libstdc++ headers in {LIBSTDCXX}")
    tmp = tmp_path_factory.mktemp("export")
    config = run_config(build_dataset(tmp), tmp / "run", train={"steps": 4, "eval_every": 2},
                        checkpoint={"every": 2, "keep_last": 2})
    train(load_run_config(write_config(tmp / "run.toml", config)),
          console=Console(file=io.StringIO()), show_progress=False)
    return tmp / "run"


def megacpp(capsys, *args: str, check: bool = True) -> tuple[int, str, str]:
    """The CLI in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    if check and code:
        raise AssertionError(f"megacpp {' '.join(args)} exited {code}: {err}")
    return code, out, err


def test_export_cli_gives_megacpp_generates_greedy_text_in_transformers(run_dir, tmp_path,
                                                                        capsys):
    out = tmp_path / "hf"
    _, stdout, _ = megacpp(capsys, "export", "hf", str(run_dir), "--out", str(out))
    assert f"wrote {out}" in stdout.replace("\n", "")
    _, stdout, _ = megacpp(capsys, "generate", "--checkpoint", str(run_dir), "--prompt", PROMPT,
                           "--temperature", "0", "--max-new-tokens", "16", "--json")
    expected = json.loads(stdout.splitlines()[0])

    tok = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        new = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:]
    text = tok.decode(new, skip_special_tokens=True)
    assert text == expected["completion"] and len(text) > 0


def test_the_model_card_comes_from_the_receipt(run_dir, tmp_path, capsys):
    step2 = run_dir / "checkpoints" / "step_000002"
    out = tmp_path / "hf"
    megacpp(capsys, "export", "hf", str(step2), "--out", str(out))
    card = (out / "README.md").read_text()
    receipt = json.loads((run_dir / "receipt.json").read_text())
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    loss2 = next(r["loss"] for r in records if r["type"] == "train" and r["step"] == 2)
    val2 = next(r["val_loss"] for r in records if r["type"] == "val" and r["step"] == 2)
    assert "library_name: transformers" in card and "pattern `AEMR`" in card
    assert f"from `{step2}` (step 2)" in card
    assert f"| training loss (last step) | {loss2:.4f} |" in card  # the step's, not the run's end
    assert f"| 2 | {val2:.4f} |" in card and "| 4 |" not in card
    train_tokens = json.loads((Path(receipt["config"]["run"]["data"]["dir"])
                               / "manifest.json").read_text())["splits"]["train"]["tokens"]
    assert "| train | " in card and f"{train_tokens:,}" in card
    assert receipt["git"]["sha"] in card
    assert "No evaluation was given" in card
    assert "trust_remote_code=True" in card and "pip install megacpp" in card


def test_export_eval_summary_goes_into_the_card(run_dir, tmp_path, capsys):
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    summary = {"pass_at_k": {"pass@1": 0.25}, "problems": {"evaluated": 4},
               "sampling": {"n": 2, "temperature": 0.8}}
    (eval_dir / "summary.json").write_text(json.dumps(summary))
    out = tmp_path / "hf"
    megacpp(capsys, "export", "hf", str(run_dir), "--out", str(out), "--eval", str(eval_dir))
    card = (out / "README.md").read_text()
    assert "| pass@1 | 0.2500 |" in card and "4 problems, n=2" in card


def test_export_bad_input_is_one_error_line(run_dir, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("keep")
    cases = [
        (("export", "hf", str(tmp_path / "missing"), "--out", str(tmp_path / "o1")),
         "not found"),
        (("export", "hf", str(tmp_path), "--out", str(tmp_path / "o2")), "neither a run"),
        (("export", "hf", str(run_dir), "--out", str(taken)), "not an empty directory"),
        (("export", "hf", str(run_dir), "--out", str(tmp_path / "o3"), "--max-shard-size",
          "big"), "--max-shard-size"),
        (("export", "hf", str(run_dir), "--out", str(tmp_path / "o4"), "--adapter-only"),
         "not of a LoRA run"),
        (("export", "hf", str(run_dir), "--out", str(tmp_path / "o5"), "--eval",
          str(tmp_path / "noeval")), "--eval"),
    ]
    for args, needle in cases:
        code, _, stderr = megacpp(capsys, *args, check=False)
        lines = stderr.strip().splitlines()
        assert code == 2, (args, stderr)
        assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], lines
    assert (taken / "x").read_text() == "keep"
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())
