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

Writes ``OUT/grpo_trl.json`` (reward and KL per step, wall time), with ``--megacpp-run``
also the megacpp run's reward per step and wall time beside them and ``OUT/grpo_trl.png``
(reward against step, both), and a receipt (kind ``bench``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

from megacpp.eval import CppVerifier, Sample, Sandbox, load_problem_set, verify_samples
from megacpp.infer.batch import CPP_BODY_STOP
from megacpp.posttrain.common import refuse_eval_only
from megacpp.posttrain.grpo import reward_of
from megacpp.receipts import write_receipt
from megacpp.train.metrics import read_metrics


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--train", type=Path, required=True)
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
    args = parser.parse_args()

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
    trainer = GRPOTrainer(model=str(args.base), reward_funcs=make_reward(
        problem_set.problems, verifier, args.workers, args.compile_credit), args=config,
        train_dataset=dataset, processing_class=tokenizer)
    for model in (trainer.model, trainer.ref_model):
        if model is not None:
            expose_backbone(model)
    started = time.monotonic()
    trainer.train()
    wall_s = time.monotonic() - started
    steps = [r for r in trainer.state.log_history if "reward" in r]
    result = {"trl": {"reward": [r["reward"] for r in steps],
                      "kl": [r.get("kl", 0.0) for r in steps], "wall_s": wall_s,
                      "steps": len(steps)},
              "settings": {k: str(v) for k, v in vars(args).items()}}
    if args.megacpp_run is not None:
        ours = [r for r in read_metrics(args.megacpp_run / "metrics.jsonl")
                if r["kind"] == "train"]
        result["megacpp"] = {"reward": [r["reward"] for r in ours],
                             "kl": [r["kl"] for r in ours],
                             # the steps' own time (sampling, verifying, updating): no
                             # held-out evaluations or checkpoints, as on TRL's side
                             "wall_s": sum(r["sample_s"] + r["verify_s"] + r["update_s"]
                                           for r in ours),
                             "steps": len(ours)}
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "grpo_trl.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    artifacts = [out, plot(result, args.out / "grpo_trl.png")]
    print(json.dumps({name: {"steps": r["steps"], "wall_s": r["wall_s"],
                             "mean_reward": sum(r["reward"]) / max(len(r["reward"]), 1)}
                      for name, r in result.items() if name != "settings"}, indent=2))
    metrics = {"trl_wall_s": wall_s,
               "trl_mean_reward": sum(result["trl"]["reward"]) / max(len(steps), 1)}
    write_receipt(args.out / "grpo_trl.receipt.json", "bench", config=result["settings"],
                  metrics=metrics, artifacts=artifacts)


def plot(result: dict, path: Path) -> Path:
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
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
