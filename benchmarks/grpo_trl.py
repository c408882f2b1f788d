"""TRL's GRPOTrainer as the peer of ``megacpp posttrain grpo``: same model, reward, steps.

Run (after ``megacpp posttrain grpo ... --lora-r 0 --out runs/pt-grpo``)::

    .venv/bin/python benchmarks/grpo_trl.py --base runs/pt-sft/model \\
        --train data/pt-tasks/train.jsonl --steps 30 --tasks-per-step 16 --group-size 8 \\
        --max-new-tokens 160 --lr 2e-5 --kl-coef 0.04 --megacpp-run runs/pt-grpo \\
        --out /tmp/grpo-trl

``--base`` is a Hugging Face export (``megacpp export hf``, or a post-training run's
``model/``), loaded by transformers with ``trust_remote_code``. TRL samples with
transformers' ``generate`` and optimizes full fine-tuning with the same clipped objective
(``loss_type="grpo"``: per-completion token mean, then the mean; ``scale_rewards="group"``;
``epsilon``; ``beta`` as the KL coefficient against the starting model). The reward is the
same function: each completion is cut at the function's closing brace, compiled and run
against its problem's tests in the megacpp sandbox (1 pass, ``--compile-credit`` compiles,
0 otherwise). Differences that remain: TRL draws its own prompt order, and generates to
``--max-new-tokens`` (the reward cuts at the brace) where the engine stops there.

Writes ``OUT/grpo_trl_steps.jsonl`` as training runs: a settings line, then one line per
optimizer step (TRL's logged numbers, the step, the seconds since training started), each
flushed when the trainer logs it, so a run cut off by a time limit keeps the steps it
finished. At the end it builds ``OUT/grpo_trl.json`` from that file (status ``complete``, or
``partial`` with the steps done when fewer than ``--steps``; reward and KL per step, wall
time), with ``--megacpp-run`` also the megacpp run's reward per step and wall time beside
them, ``OUT/grpo_trl.png`` (reward against step, both) and a receipt (kind ``bench``).
``--report-only --out OUT`` builds those three from an existing ``grpo_trl_steps.jsonl``
without training (the settings come from its first line)::

    .venv/bin/python benchmarks/grpo_trl.py --report-only --out /tmp/grpo-trl \
        --megacpp-run runs/pt-grpo
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from megacpp.errors import MegaCppError
from megacpp.eval import CppVerifier, Sample, Sandbox, load_problem_set, verify_samples
from megacpp.infer.batch import CPP_BODY_STOP
from megacpp.posttrain.common import refuse_eval_only
from megacpp.posttrain.grpo import reward_of
from megacpp.receipts import write_receipt
from megacpp.train.metrics import MetricsLog, read_metrics

STEPS_FILE = "grpo_trl_steps.jsonl"
RESULT_FILE = "grpo_trl.json"
PLOT_FILE = "grpo_trl.png"
RECEIPT_FILE = "grpo_trl.receipt.json"


def function_body(completion: str) -> str:
    """The completion cut at the function's closing brace, with the brace put back (as the
    engine's stop does)."""
    end = completion.find(CPP_BODY_STOP)
    return completion if end < 0 else completion[:end] + CPP_BODY_STOP + "\n"


def make_reward(problems, verifier: CppVerifier, workers: int, compile_credit: float):
    by_prompt = {p.prompt: p for p in problems}

    def verifier_reward(prompts, completions, **_) -> list[float]:
        chosen = [by_prompt[prompt] for prompt in prompts]
        samples = [Sample(p.task_id, i, function_body(c))
                   for i, (p, c) in enumerate(zip(chosen, completions))]
        results = verify_samples(verifier, list({p.task_id: p for p in chosen}.values()),
                                 samples, workers=workers)
        return [reward_of(r.verdict.status, compile_credit) for r in results]

    return verifier_reward


def accept_right_padding(model_class) -> None:
    """Let the exported model take batches whose rows are right-padded (a row's tokens, then
    padding), as TRL's log-prob pass builds them: a causal model's positions before the
    padding never see it, so the mask is dropped. Left padding is still refused (each
    generation batch here is one prompt's group, so prompts are never padded)."""
    forward = model_class.forward

    def forward_right_padded(self, input_ids=None, attention_mask=None, **kwargs):
        if attention_mask is not None and not bool(attention_mask.all()):
            ones = attention_mask.long().cumprod(dim=1).sum(dim=1, keepdim=True)
            right_padded = (attention_mask.long().sum(dim=1, keepdim=True) == ones).all()
            if bool(right_padded):
                attention_mask = None
        return forward(self, input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    model_class.forward = forward_right_padded


def exported_model_class(base: Path) -> type:
    """The class ``AutoModelForCausalLM`` builds for the export at ``base`` (its remote code,
    the same class object transformers caches), without loading the weights."""
    from transformers import AutoConfig
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    config = AutoConfig.from_pretrained(base, trust_remote_code=True)
    return get_class_from_dynamic_module(config.auto_map["AutoModelForCausalLM"], base)


def expose_backbone(causal_lm) -> None:
    """TRL scores completions through a fused LM head: it calls the backbone
    (``base_model``, here the HybridLM) with Hugging Face keywords, reads
    ``last_hidden_state`` and projects with ``get_output_embeddings()``'s weight and bias.
    Give this model's HybridLM that call (right padding allowed, as above) and its tied head
    as the output embedding (the embedding matrix, no bias)."""
    hybrid = causal_lm.model

    def backbone(input_ids=None, attention_mask=None, **_):
        if attention_mask is not None and not bool(attention_mask.all()):
            mask = attention_mask.long()
            if not bool((mask.cumprod(dim=1).sum(dim=1) == mask.sum(dim=1)).all()):
                raise ValueError("left-padded rows: the benchmark runs one prompt per batch")
        return SimpleNamespace(last_hidden_state=hybrid.hidden_states(input_ids))

    hybrid.forward = backbone
    head = hybrid.lm_head
    tied = SimpleNamespace(weight=hybrid.embed.weight, bias=None)
    causal_lm.get_output_embeddings = lambda: head if head is not None else tied


# -- the per-step log (no TRL needed) ------------------------------------------------------------
def step_record(logs: dict[str, Any], step: int, elapsed_s: float) -> dict[str, Any] | None:
    """The JSONL record of one trainer log: its numbers (a non-finite one as null), the
    optimizer step and the seconds since training started; None for a log without a reward
    (the end-of-training summary)."""
    if "reward" not in logs:
        return None
    record: dict[str, Any] = {"kind": "step", "step": int(step), "elapsed_s": round(elapsed_s, 3)}
    for key, value in logs.items():
        if isinstance(value, bool) or not isinstance(value, int | float | None):
            continue
        record.setdefault(key, value if value is None or math.isfinite(value) else None)
    return record


class StepLog:
    """``OUT/grpo_trl_steps.jsonl``: a settings line, then a line per step, each flushed as it
    is written (the metrics log of ``megacpp train``)."""

    def __init__(self, out: Path) -> None:
        Path(out).mkdir(parents=True, exist_ok=True)
        self.log = MetricsLog(Path(out) / STEPS_FILE)
        self.started = time.monotonic()

    def start(self, settings: dict[str, str]) -> None:
        """An empty log holding ``settings``; the step clock starts now."""
        self.log.reset()
        self.log.write({"kind": "settings", "step": 0, "settings": settings})
        self.started = time.monotonic()

    def on_log(self, logs: dict[str, Any], step: int) -> None:
        record = step_record(logs, step, time.monotonic() - self.started)
        if record is not None:
            self.log.write(record)


def step_callback(step_log: StepLog):
    """A ``transformers.TrainerCallback`` whose ``on_log`` appends each logged step to
    ``step_log`` (on the main process)."""
    from transformers import TrainerCallback

    class WriteSteps(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs:
                step_log.on_log(logs, state.global_step)

    return WriteSteps()


# -- the report (from the per-step log) -----------------------------------------------------------
def build_report(out: Path, megacpp_run: Path | None = None) -> dict[str, Any]:
    """``grpo_trl.json``'s content from ``OUT/grpo_trl_steps.jsonl`` (a run cut short, even
    mid-line, included) and, with ``megacpp_run``, that run's metrics."""
    path = Path(out) / STEPS_FILE
    if not path.is_file():
        raise MegaCppError(f"{path} not found: run the benchmark with --out {out} first")
    records = read_metrics(path, tolerate_partial=True)
    if not records or records[0].get("kind") != "settings":
        raise MegaCppError(f"{path}: the first line is not the settings line the benchmark "
                           "writes; not a grpo_trl step log")
    settings = records[0]["settings"]
    steps = [r for r in records[1:] if r.get("kind") == "step"]
    target = int(settings["steps"])
    trl = {"reward": [r["reward"] for r in steps], "kl": [r.get("kl") or 0.0 for r in steps],
           # seconds from the start of training to the last logged step
           "wall_s": steps[-1]["elapsed_s"] if steps else 0.0, "steps": len(steps)}
    result = {"status": "complete" if len(steps) >= target else "partial",
              "steps_done": len(steps), "steps_target": target, "trl": trl,
              "settings": settings}
    if megacpp_run is not None:
        ours = [r for r in read_metrics(Path(megacpp_run) / "metrics.jsonl")
                if r["kind"] == "train"]
        result["megacpp"] = {"reward": [r["reward"] for r in ours],
                             "kl": [r["kl"] for r in ours],
                             # the steps' own time (sampling, verifying, updating): no
                             # held-out evaluations or checkpoints, as on TRL's side
                             "wall_s": sum(r["sample_s"] + r["verify_s"] + r["update_s"]
                                           for r in ours),
                             "steps": len(ours)}
    return result


def write_report(out: Path, result: dict[str, Any]) -> list[Path]:
    """``grpo_trl.json``, ``grpo_trl.png`` and the receipt; prints the summary."""
    out = Path(out)
    path = out / RESULT_FILE
    path.write_text(json.dumps(result, indent=2) + "\n")
    artifacts = [path, plot(result, out / PLOT_FILE), out / STEPS_FILE]
    summary = {name: {"steps": r["steps"], "wall_s": r["wall_s"],
                      "mean_reward": sum(r["reward"]) / max(len(r["reward"]), 1)}
               for name, r in result.items() if name in ("trl", "megacpp")}
    print(json.dumps({"status": result["status"], "steps_done": result["steps_done"],
                      "steps_target": result["steps_target"], **summary}, indent=2))
    trl = result["trl"]
    metrics = {"trl_wall_s": trl["wall_s"], "trl_steps": float(trl["steps"]),
               "trl_steps_target": float(result["steps_target"]),
               "trl_mean_reward": sum(trl["reward"]) / max(trl["steps"], 1)}
    write_receipt(out / RECEIPT_FILE, "bench",
                  config={**result["settings"], "status": result["status"]},
                  metrics=metrics, artifacts=artifacts)
    return artifacts


# -- the run ------------------------------------------------------------------------------------
def train(args: argparse.Namespace) -> None:
    """TRL's GRPOTrainer on ``args``; every logged step goes to ``OUT/grpo_trl_steps.jsonl``."""
    import datasets
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    problem_set = load_problem_set(args.train)
    refuse_eval_only((p.prompt for p in problem_set.problems), str(args.train))
    verifier = CppVerifier(problem_set.suite.build_options(), Sandbox())
    tokenizer = AutoTokenizer.from_pretrained(args.base, trust_remote_code=True)
    dataset = datasets.Dataset.from_list([{"prompt": p.prompt} for p in problem_set.problems])
    accept_right_padding(exported_model_class(args.base))
    # one prompt's group per generation batch (the exported model takes no left padding);
    # tasks_per_step groups are accumulated into one optimizer step
    config = GRPOConfig(
        output_dir=str(args.out / "trl"), max_steps=args.steps,
        per_device_train_batch_size=args.group_size,
        gradient_accumulation_steps=args.tasks_per_step, steps_per_generation=1,
        num_generations=args.group_size, max_completion_length=args.max_new_tokens,
        temperature=args.temperature, learning_rate=args.lr, beta=args.kl_coef,
        epsilon=args.clip_eps, loss_type="grpo", scale_rewards="group", num_iterations=1,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, weight_decay=0.0,
        logging_steps=1, report_to="none", save_strategy="no", seed=args.seed,
        gradient_checkpointing=False,  # the exported model does not support it
        use_cpu=args.device == "cpu", bf16=args.device == "cuda",
        model_init_kwargs={"trust_remote_code": True})  # policy and reference
    step_log = StepLog(args.out)
    trainer = GRPOTrainer(model=str(args.base), reward_funcs=make_reward(
        problem_set.problems, verifier, args.workers, args.compile_credit), args=config,
        train_dataset=dataset, processing_class=tokenizer, callbacks=[step_callback(step_log)])
    for model in (trainer.model, trainer.ref_model):
        if model is not None:
            expose_backbone(model)
    step_log.start(run_settings(args))
    trainer.train()


def run_settings(args: argparse.Namespace) -> dict[str, str]:
    return {k: str(v) for k, v in vars(args).items() if k not in ("report_only", "megacpp_run")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, default=None)
    parser.add_argument("--train", type=Path, default=None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--tasks-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--kl-coef", type=float, default=0.04)
    parser.add_argument("--clip-eps", type=float, default=0.2)
    parser.add_argument("--compile-credit", type=float, default=0.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--megacpp-run", type=Path, default=None,
                        help="A megacpp posttrain grpo run to put beside TRL's numbers.")
    parser.add_argument("--report-only", action="store_true",
                        help="Build grpo_trl.json/.png and the receipt from OUT's "
                             f"{STEPS_FILE} (a finished or cut-off run) without training.")
    args = parser.parse_args(argv)
    if not args.report_only:
        missing = [f"--{name}" for name in ("base", "train") if getattr(args, name) is None]
        if missing:
            parser.error(f"{' and '.join(missing)} required (or --report-only)")
        if args.steps < 1:
            parser.error(f"--steps {args.steps}: expected >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if not args.report_only:
            train(args)
        write_report(args.out, build_report(args.out, args.megacpp_run))
    except MegaCppError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def plot(result: dict, path: Path) -> Path:
    """Reward against step, TRL's and (when present) megacpp's, with their wall times."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in ("megacpp", "trl"):
        if name in result:
            rewards = result[name]["reward"]
            ax.plot(range(1, len(rewards) + 1), rewards,
                    label=f"{name} ({result[name]['wall_s']:.0f} s)")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    if result.get("status") == "partial":
        ax.set_title(f"TRL partial: {result['steps_done']} of {result['steps_target']} steps")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    sys.exit(main())
