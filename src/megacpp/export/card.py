"""The model card (README.md) of a Hugging Face export, written from the run's records: its
receipt (config, outcome, environment), metrics.jsonl (losses), the dataset's manifest and
any eval summaries given. Every number in the card is read from one of those files."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megacpp import __version__
from megacpp.errors import MegaCppError
from megacpp.model.config import ModelConfig
from megacpp.model.counting import count_model
from megacpp.receipts import read_receipt


@dataclass
class CardFacts:
    """What the card says, as read from the run's files (None / empty: not recorded)."""

    run_dir: Path
    checkpoint: Path
    step: int | None = None
    tokens: int | None = None
    receipt: dict[str, Any] | None = None  # config, metrics, created, git, packages
    train_losses: list[tuple[int, float]] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    manifest: dict[str, Any] | None = None
    data_dir: Path | None = None
    evals: list[tuple[Path, dict[str, Any]]] = field(default_factory=list)

    @classmethod
    def collect(cls, run_dir: Path, checkpoint: Path, trainer_state: dict[str, Any],
                data_dir: Path | None, eval_dirs: tuple[Path, ...] = ()) -> CardFacts:
        facts = cls(run_dir, checkpoint, trainer_state.get("step"), trainer_state.get("tokens"),
                    data_dir=data_dir)
        receipt_path = run_dir / "receipt.json"
        if receipt_path.is_file():
            receipt = read_receipt(receipt_path)
            facts.receipt = {"config": receipt.config, "metrics": receipt.metrics,
                             "created": receipt.created, "git": receipt.git,
                             "packages": receipt.fingerprint.get("packages", {})}
        facts._read_metrics(run_dir / "metrics.jsonl")
        if data_dir is not None and (data_dir / "manifest.json").is_file():
            facts.manifest = json.loads((data_dir / "manifest.json").read_text("utf-8"))
        for eval_dir in eval_dirs:
            summary = Path(eval_dir) / "summary.json"
            try:
                facts.evals.append((Path(eval_dir), json.loads(summary.read_text("utf-8"))))
            except (OSError, ValueError) as exc:
                raise MegaCppError(f"--eval {eval_dir}: cannot read {summary} ({exc})") from None
        return facts

    def _read_metrics(self, path: Path) -> None:
        if not path.is_file():
            return
        for line in path.read_text("utf-8").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut by a crash: the card shows the complete ones
            if self.step is not None and record.get("step", 0) > self.step:
                continue  # after the exported checkpoint
            if record.get("type") == "train" and record.get("loss") is not None:
                self.train_losses.append((record["step"], record["loss"]))
            elif record.get("type") == "val" and record.get("val_loss") is not None:
                self.val_losses.append((record["step"], record["val_loss"]))


def model_card(cfg: ModelConfig, facts: CardFacts, name: str) -> str:
    """The README.md text."""
    cost = count_model(cfg)
    run = (facts.receipt or {}).get("config", {}).get("run", {})
    lines = [
        "---", "library_name: transformers", "pipeline_tag: text-generation",
        "tags: [megacpp, code, cpp, custom_code]", "---", "",
        f"# {name}", "",
        f"A MegaCpp hybrid language model for C++ code: pattern `{cfg.pattern}`, "
        f"{cost.params:,} parameters ({cost.active_params:,} active per token), exported by "
        f"`megacpp export hf` from `{facts.checkpoint}`"
        + (f" (step {facts.step:,})." if facts.step is not None else "."), "",
        "## Use", "",
        ("The modeling file wraps megacpp's own model code, so megacpp must be installed "
        "(`pip install megacpp`, with `transformers`):"), "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'tokenizer = AutoTokenizer.from_pretrained("{name}", trust_remote_code=True)',
        f'model = AutoModelForCausalLM.from_pretrained("{name}", trust_remote_code=True)',
        'ids = tokenizer("int add(int a, int b) {", return_tensors="pt").input_ids',
        "out = model.generate(ids, max_new_tokens=32)",
        "print(tokenizer.decode(out[0], skip_special_tokens=True))",
        "```", "",
        ("The tokenizer puts `<|bos|>` first, as megacpp does (transformers 5 reads config.json "
        "for the tokenizer too: `trust_remote_code=True` saves its question). Decoding is "
        "greedy by default "
        "(`do_sample=True, temperature=0.8, top_p=0.95` sample as `megacpp generate` does); "
        "beam search and padded batches are not supported."), "",
        "## Model", "",
        "| | |", "| --- | --- |",
        f"| pattern | `{cfg.pattern}` |",
        f"| d_model | {cfg.d_model} |",
        f"| vocabulary | {cfg.vocab_size:,} |",
        f"| parameters | {cost.params:,} ({cost.active_params:,} active) |",
        f"| multi-token prediction | {cfg.mtp.depth or 'off'} |",
        "", "The whole model config is `megacpp` in config.json.", "",
    ]
    lines += _data_section(facts)
    lines += _training_section(facts, run)
    lines += _eval_section(facts)
    lines += _provenance_section(facts)
    return "\n".join(lines) + "\n"


def _data_section(facts: CardFacts) -> list[str]:
    lines = ["## Training data", ""]
    manifest = facts.manifest
    if manifest is None:
        where = f" ({facts.data_dir})" if facts.data_dir else ""
        return lines + [f"The dataset's manifest was not found{where}.", ""]
    splits = manifest.get("splits", {})
    lines += [f"`megacpp data build` dataset `{facts.data_dir}`, from "
              + ", ".join(f"`{s}`" for s in manifest.get("sources", [])) + ".", "",
              "| split | documents | tokens |", "| --- | --- | --- |"]
    for split, info in splits.items():
        lines.append(f"| {split} | {info.get('documents', 0):,} | {info.get('tokens', 0):,} |")
    tok = manifest.get("tokenizer", {})
    lines += ["", (f"Rows of {manifest.get('seq_len')} tokens; tokenizer: {tok.get('vocab_size')} "
              f"tokens, sha256 `{tok.get('sha256')}`."), ""]
    return lines


def _training_section(facts: CardFacts, run: dict[str, Any]) -> list[str]:
    lines = ["## Training", ""]
    metrics = (facts.receipt or {}).get("metrics", {})
    train_cfg = run.get("train", {})
    last_train = facts.train_losses[-1][1] if facts.train_losses else None
    last_val = facts.val_losses[-1][1] if facts.val_losses else None
    rows = [("steps", facts.step), ("tokens", facts.tokens),
            ("training loss (last step)", last_train),
            ("validation loss (last evaluation)", last_val),
            ("devices", metrics.get("world_size")),
            ("init_from", train_cfg.get("init_from") or None),
            ("frozen", ", ".join(train_cfg.get("freeze", [])) or None)]
    lora = run.get("lora", {})
    if lora.get("r"):
        rows.append(("LoRA", f"r={lora['r']}, alpha={lora['alpha']} (merged into the weights)"))
    lines += ["| | |", "| --- | --- |"]
    lines += [f"| {key} | {_fmt(value)} |" for key, value in rows if value is not None]
    if facts.receipt is None:
        lines += ["", "The run has no receipt.json (its training did not finish)."]
    if facts.train_losses:
        (s0, l0), (s1, l1) = facts.train_losses[0], facts.train_losses[-1]
        lines += ["", (f"Training loss {l0:.4f} at step {s0} -> {l1:.4f} at step {s1} "
                  "(metrics.jsonl).")]
    if facts.val_losses:
        lines += ["", "| step | validation loss |", "| --- | --- |"]
        lines += [f"| {step} | {loss:.4f} |" for step, loss in facts.val_losses]
    return lines + [""]


def _eval_section(facts: CardFacts) -> list[str]:
    lines = ["## Evaluation", ""]
    if not facts.evals:
        return lines + [("No evaluation was given to the export (`megacpp export hf --eval "
                        "EVAL_DIR` adds a `megacpp eval` summary)."), ""]
    for eval_dir, summary in facts.evals:
        problems = summary.get("problems", {})
        sampling = summary.get("sampling", {})
        lines += [(f"`{eval_dir}`: {problems.get('evaluated', '?')} problems, "
                  f"n={sampling.get('n', '?')}, temperature {sampling.get('temperature', '?')}"),
                  "", "| metric | value |", "| --- | --- |"]
        lines += [f"| {k} | {v:.4f} |" for k, v in summary.get("pass_at_k", {}).items()]
        lines.append("")
    return lines


def _provenance_section(facts: CardFacts) -> list[str]:
    receipt = facts.receipt or {}
    git = receipt.get("git") or {}
    packages = receipt.get("packages") or {}
    lines = ["## Provenance", "", f"- run directory: `{facts.run_dir}`",
             f"- exported with megacpp {__version__}"]
    if receipt:
        lines.append(f"- trained {receipt.get('created')} with torch {packages.get('torch')}"
                     + (f", megacpp at git `{git.get('sha')}`" if git.get("sha") else ""))
    return lines


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if not value.is_integer() else f"{int(value):,}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)
