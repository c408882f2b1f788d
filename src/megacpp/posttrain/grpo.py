"""Group-relative policy optimization (GRPO) with the sandboxed C++ verifier as the reward.

One step:

1. pick ``tasks_per_step`` training problems (a seeded shuffle, epoch by epoch);
2. sample ``group_size`` completions of each prompt through the serving engine
   (:class:`~megacpp.infer.engine.Engine`, one engine kept for the whole run; sampling stops
   at the closing brace of the function, which is put back);
3. compile and run every completion against its problem's tests in the sandbox
   (:func:`megacpp.eval.verify_samples`): reward 1 when the tests pass, ``compile_credit``
   when the program compiles but fails, 0 otherwise;
4. advantages, per group: ``(r - mean(r)) / (std(r) + eps)`` (a group whose rewards are all
   equal teaches nothing: its advantages are 0);
5. ``inner_steps`` updates of the clipped objective, per completion token ``t``::

       ratio_t = exp(logp_t - logp_old_t)
       obj_t   = min(ratio_t * A, clip(ratio_t, 1 - eps, 1 + eps) * A) - beta * kl_t
       kl_t    = exp(ref_t - logp_t) - (ref_t - logp_t) - 1     (k3, >= 0, 0 when equal)

   averaged over each completion's tokens, then over completions; the loss is ``-obj``.
   Prompt positions carry no loss. ``ref`` is a frozen copy of the starting model.

Every step writes a line to ``metrics.jsonl`` (reward, pass rate, compile rate, KL, clip
fraction, loss, times); every ``eval_every`` steps (and at step 0 and the end) the held-out
problems are decoded greedily and their pass@1 is logged. ``plot.png`` shows reward and
held-out pass@1 against step.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from megacpp.data.tokenizer import CppTokenizer
from megacpp.eval import CppVerifier, Problem, Sample, Status, verify_samples
from megacpp.infer.batch import CPP_BODY_STOP, BatchRequest, close_function_body, run_batch
from megacpp.infer.cache_manager import pool_bytes
from megacpp.infer.engine import Engine, EngineConfig
from megacpp.infer.generate import BLOCK_SIZE
from megacpp.infer.memory import check_fits
from megacpp.infer.sampling import SamplingParams, sample_seed
from megacpp.model.model import IGNORE_INDEX, HybridLM
from megacpp.posttrain.common import (
    LoraOptions,
    PosttrainError,
    autocast,
    check_out_dir,
    frozen_copy,
    index_batches,
    make_policy,
    model_card,
    open_metrics_log,
    publish_final,
    refuse_eval_only,
    require_at_least_one,
    save_checkpoint,
    trainable_parameters,
    write_run_receipt,
)
from megacpp.posttrain.sft import completion_batch, prompt_ids

ADVANTAGE_EPS = 1e-4
PLOT_FILE = "plot.png"


@dataclass(frozen=True)
class GrpoConfig:
    steps: int = 50
    tasks_per_step: int = 8
    group_size: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 192
    lr: float = 1e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    clip_eps: float = 0.2
    kl_coef: float = 0.04
    inner_steps: int = 1
    compile_credit: float = 0.0
    micro_batch: int = 16  # completions per forward/backward
    eval_every: int = 10  # 0: held-out pass@1 only at step 0 and the end
    eval_limit: int | None = None  # held-out problems evaluated (None: all)
    time_budget_s: float = 0.0  # stop after the step that passes this many seconds (0: none)
    save_every: int = 0
    seed: int = 0
    workers: int = 4  # verifier threads
    lora: LoraOptions = field(default_factory=LoraOptions)

    def check(self) -> None:
        require_at_least_one(self, ("steps", "tasks_per_step", "group_size", "max_new_tokens",
                                    "inner_steps", "micro_batch", "workers"))
        if self.group_size < 2:
            raise PosttrainError(f"--group-size {self.group_size}: GRPO compares completions "
                                 "within a group; expected >= 2")
        for name, low, high in (("lr", 0, math.inf), ("clip_eps", 0, 1),
                                ("temperature", 0, 10)):
            value = getattr(self, name)
            if not (math.isfinite(value) and low < value <= high):
                raise PosttrainError(f"--{name.replace('_', '-')} {value}: expected a number "
                                     f"in ({low}, {high}]")
        if not (math.isfinite(self.kl_coef) and self.kl_coef >= 0):
            raise PosttrainError(f"--kl-coef {self.kl_coef}: expected a number >= 0")
        if not 0 <= self.compile_credit < 1:
            raise PosttrainError(f"--compile-credit {self.compile_credit}: expected a number in "
                                 "[0, 1)")
        if not (math.isfinite(self.time_budget_s) and self.time_budget_s >= 0):
            raise PosttrainError(f"--time-budget-s {self.time_budget_s}: expected a number >= 0")
        if self.eval_every < 0 or self.save_every < 0:
            raise PosttrainError("--eval-every and --save-every must be >= 0")
        if self.eval_limit is not None and self.eval_limit < 1:
            raise PosttrainError(f"--eval-limit {self.eval_limit}: expected >= 1")
        self.lora.check()


# -- the math -----------------------------------------------------------------------------------
def group_advantages(rewards: torch.Tensor, eps: float = ADVANTAGE_EPS) -> torch.Tensor:
    """[groups, G] rewards -> [groups, G] advantages ``(r - mean) / (std + eps)`` per group
    (std as torch computes it, unbiased)."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)
    return (rewards - mean) / (std + eps)


def token_logprobs(model: HybridLM, input_ids: torch.Tensor, labels: torch.Tensor
                   ) -> torch.Tensor:
    """[B, L] log-probabilities of the targets ``labels`` (0 where ignored); the forward runs
    under bf16 autocast on CUDA, the log-softmax in float32."""
    with autocast(input_ids.device):
        logits = model(input_ids).logits
    logits = logits.float()  # [B, L, V]
    mask = labels != IGNORE_INDEX
    picked = torch.gather(F.log_softmax(logits, dim=-1), 2,
                          labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [B, L]
    return picked * mask


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference): ``exp(d) - d - 1``, ``d = ref - logp``."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def grpo_objective(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor,
                   advantages: torch.Tensor, mask: torch.Tensor, clip_eps: float,
                   kl_coef: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss summed over the rows -- divide by the number of completions --, stats) for
    per-token log-probs [B, L] and advantages [B]; ``mask`` [B, L] marks completion tokens."""
    mask = mask.to(logp.dtype)
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    kl = kl_k3(logp, ref_logp)
    per_token = -(surrogate - kl_coef * kl) * mask
    tokens = mask.sum(dim=1).clamp(min=1)
    loss = (per_token.sum(dim=1) / tokens).sum()
    clipped = ((ratio - 1).abs() > clip_eps).to(logp.dtype) * mask
    stats = {"kl": ((kl * mask).sum(dim=1) / tokens).detach(),
             "clipped": (clipped.sum(dim=1) / tokens).detach()}
    return loss, stats


def reward_of(status: Status, compile_credit: float) -> float:
    if status is Status.PASSED:
        return 1.0
    return 0.0 if status is Status.COMPILE_ERROR else compile_credit


# -- sampling through the engine ----------------------------------------------------------------
@dataclass
class Rollout:
    task: Problem
    prompt_ids: list[int]  # BOS + prompt
    token_ids: list[int]  # the sampled tokens (EOS included when it ended the completion)
    completion: str  # the function body the verifier compiled


class PolicySampler:
    """One engine over the policy for the whole run (its weights are the live parameters)."""

    def __init__(self, model: HybridLM, tokenizer: CppTokenizer, device: torch.device,
                 rows: int, longest_prompt: int, max_new_tokens: int) -> None:
        self.model, self.tokenizer = model, tokenizer
        max_model_len = longest_prompt + max_new_tokens
        has_attention = any(layout is not None for layout in model.paged_layouts())
        block_size = BLOCK_SIZE if has_attention else max_model_len
        num_blocks = rows * -(-max_model_len // block_size)
        dtype = next(model.parameters()).dtype
        check_fits(pool_bytes(model, num_blocks, block_size, rows, dtype), device,
                   f"the sampling cache of {rows} completions", "lower --tasks-per-step, "
                   "--group-size or --max-new-tokens")
        config = EngineConfig(max_num_seqs=rows, block_size=block_size, num_blocks=num_blocks,
                              max_model_len=max_model_len)
        self.engine = Engine(model, tokenizer, config, device, dtype)

    @torch.no_grad()
    def sample(self, tasks: Sequence[Problem], n: int, params: SamplingParams) -> list[Rollout]:
        """``n`` completions of every task (task order, then sample order)."""
        self.model.eval()
        ids = [prompt_ids(self.tokenizer, task.prompt) for task in tasks]
        requests = [BatchRequest(f"{i}/{j}", ids[i], _with_seed(params, j))
                    for i in range(len(tasks)) for j in range(n)]
        results = run_batch(self.engine, requests)
        return [Rollout(task, ids[i], results[f"{i}/{j}"].token_ids,
                        close_function_body(results[f"{i}/{j}"].text,
                                            results[f"{i}/{j}"].finish_reason))
                for i, task in enumerate(tasks) for j in range(n)]


def _with_seed(params: SamplingParams, j: int) -> SamplingParams:
    return dataclasses.replace(params, seed=sample_seed(params.seed, j))


def score(verifier: CppVerifier, rollouts: Sequence[Rollout], workers: int
          ) -> list[Status]:
    """The verifier's status for every rollout (real compile + run in the sandbox)."""
    problems = list({r.task.task_id: r.task for r in rollouts}.values())
    samples = [Sample(r.task.task_id, i, r.completion) for i, r in enumerate(rollouts)]
    return [result.verdict.status for result in
            verify_samples(verifier, problems, samples, workers=workers)]


# -- the loop -----------------------------------------------------------------------------------
@dataclass
class GrpoRun:
    """Everything one run holds; :meth:`step` is one GRPO step."""

    model: HybridLM
    reference: HybridLM
    tokenizer: CppTokenizer
    verifier: CppVerifier
    cfg: GrpoConfig
    device: torch.device
    sampler: PolicySampler
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    order: Any  # the task index batches

    def update(self, rollouts: Sequence[Rollout], advantages: torch.Tensor
               ) -> dict[str, float]:
        """``inner_steps`` optimizer steps on the rollouts; stats of the first pass."""
        cfg, n = self.cfg, len(rollouts)
        chunks = [range(i, min(i + cfg.micro_batch, n)) for i in range(0, n, cfg.micro_batch)]
        batches = [completion_batch([(rollouts[i].prompt_ids + rollouts[i].token_ids,
                                      len(rollouts[i].prompt_ids)) for i in chunk],
                                    self.tokenizer.pad_id) for chunk in chunks]
        batches = [(x.to(self.device), y.to(self.device)) for x, y in batches]
        self.model.train()
        with torch.no_grad():
            ref = [token_logprobs(self.reference, x, y) for x, y in batches]
            old = None
            if cfg.inner_steps > 1:
                old = [token_logprobs(self.model, x, y) for x, y in batches]
        first: dict[str, float] = {}
        for inner in range(cfg.inner_steps):
            self.optimizer.zero_grad(set_to_none=True)
            total_loss, kl, clipped = 0.0, 0.0, 0.0
            for k, (chunk, (x, y)) in enumerate(zip(chunks, batches)):
                logp = token_logprobs(self.model, x, y)
                old_logp = logp.detach() if old is None else old[k]
                loss, stats = grpo_objective(logp, old_logp, ref[k],
                                             advantages[list(chunk)].to(self.device),
                                             y != IGNORE_INDEX, cfg.clip_eps, cfg.kl_coef)
                (loss / n).backward()
                total_loss += loss.item() / n
                kl += stats["kl"].sum().item() / n
                clipped += stats["clipped"].sum().item() / n
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
            self.optimizer.step()
            if inner == 0:
                first = {"loss": total_loss, "kl": kl, "clip_fraction": clipped,
                         "grad_norm": float(grad_norm)}
        return first

    def step(self, step: int, tasks: Sequence[Problem]) -> dict[str, Any]:
        cfg = self.cfg
        started = time.monotonic()
        params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p,
                                max_new_tokens=cfg.max_new_tokens, stop=(CPP_BODY_STOP,),
                                seed=cfg.seed * 1_000_003 + step * 10_007)
        chosen = [tasks[i] for i in next(self.order)]
        rollouts = self.sampler.sample(chosen, cfg.group_size, params)
        sampled = time.monotonic()
        statuses = score(self.verifier, rollouts, cfg.workers)
        verified = time.monotonic()
        rewards = torch.tensor([reward_of(s, cfg.compile_credit) for s in statuses])
        advantages = group_advantages(rewards.view(len(chosen), cfg.group_size)).flatten()
        stats = self.update(rollouts, advantages)
        n = len(statuses)
        return {
            "kind": "train", "step": step,
            "reward": rewards.mean().item(),
            "pass_rate": sum(s is Status.PASSED for s in statuses) / n,
            "compile_rate": sum(s is not Status.COMPILE_ERROR for s in statuses) / n,
            **stats,
            "completion_tokens": sum(len(r.token_ids) for r in rollouts) / n,
            "sample_s": round(sampled - started, 3), "verify_s": round(verified - sampled, 3),
            "update_s": round(time.monotonic() - verified, 3),
        }

    def heldout_pass_at_1(self, heldout: Sequence[Problem]) -> float:
        """Greedy pass@1 of the held-out problems (one completion each)."""
        params = SamplingParams(temperature=0.0, max_new_tokens=self.cfg.max_new_tokens,
                                stop=(CPP_BODY_STOP,))
        statuses = score(self.verifier, self.sampler.sample(heldout, 1, params),
                         self.cfg.workers)
        return sum(s is Status.PASSED for s in statuses) / len(statuses)


def run_grpo(model: HybridLM, tokenizer: CppTokenizer, train: Sequence[Problem],
             heldout: Sequence[Problem], verifier: CppVerifier, out: Path, cfg: GrpoConfig, *,
             base: str, device: str | torch.device = "cpu",
             on_record: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run GRPO on ``train`` (held-out pass@1 on ``heldout``); writes ``out`` and returns the
    summary metrics."""
    cfg.check()
    if not train:
        raise PosttrainError("no training problems")
    refuse_eval_only((p.prompt for p in train), "the GRPO training problems")
    shared = {p.prompt for p in train} & {p.prompt for p in heldout}
    if shared:
        raise PosttrainError(f"the training and held-out problems share {len(shared)} "
                             "prompt(s); the held-out set must be disjoint from training")
    out = Path(out)
    check_out_dir(out)
    device = torch.device(device)
    torch.manual_seed(cfg.seed)
    model = model.to(device)
    reference = frozen_copy(model)
    lora = make_policy(model, cfg.lora)
    params = trainable_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    eval_set = list(heldout[:cfg.eval_limit] if cfg.eval_limit else heldout)
    longest = max(len(prompt_ids(tokenizer, p.prompt)) for p in [*train, *eval_set])
    sampler = PolicySampler(model, tokenizer, device, cfg.tasks_per_step * cfg.group_size,
                            longest, cfg.max_new_tokens)
    run = GrpoRun(model, reference, tokenizer, verifier, cfg, device, sampler, optimizer,
                  params, index_batches(len(train), cfg.tasks_per_step, cfg.seed))
    config = {"posttrain": "grpo", "base": base, "train_problems": len(train),
              "heldout_problems": len(eval_set), **asdict(cfg),
              "trainable_parameters": sum(p.numel() for p in params),
              "pattern": model.cfg.pattern, "build": asdict(verifier.build),
              "isolation": verifier.sandbox.isolation.value}
    card = model_card("grpo", base, config)
    log = open_metrics_log(out)
    started = time.monotonic()
    records: list[dict[str, Any]] = []

    def emit(record: dict[str, Any]) -> None:
        record["elapsed_s"] = round(time.monotonic() - started, 3)
        records.append(record)
        log.write(record)
        if on_record is not None:
            on_record(record)

    def evaluate(step: int) -> None:
        if eval_set:
            emit({"kind": "eval", "step": step,
                  "heldout_pass@1": run.heldout_pass_at_1(eval_set)})

    checkpoint = None
    evaluate(0)
    steps_started = time.monotonic()  # the budget counts GRPO steps, not the first eval
    for step in range(1, cfg.steps + 1):
        emit(run.step(step, train))
        last = step == cfg.steps or (cfg.time_budget_s > 0 and
                                     time.monotonic() - steps_started >= cfg.time_budget_s)
        if (cfg.eval_every and step % cfg.eval_every == 0) or last:
            evaluate(step)
        if (cfg.save_every and step % cfg.save_every == 0) or last:
            checkpoint = save_checkpoint(out, step, model, tokenizer, lora, base, card)
        if last:
            break
    final = publish_final(out, checkpoint)
    plot = plot_grpo(records, out / PLOT_FILE)
    train_records = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    metrics = {"steps": float(len(train_records)), "first_reward": train_records[0]["reward"],
               "final_reward": train_records[-1]["reward"],
               "mean_reward": sum(r["reward"] for r in train_records) / len(train_records),
               "final_kl": train_records[-1]["kl"], "wall_s": time.monotonic() - started}
    if evals:
        metrics["base_heldout_pass@1"] = evals[0]["heldout_pass@1"]
        metrics["final_heldout_pass@1"] = evals[-1]["heldout_pass@1"]
    write_run_receipt(out, config, metrics, [log.path, plot, final / "config.json"])
    return metrics


def plot_grpo(records: Sequence[dict[str, Any]], path: Path) -> Path:
    """Reward (per step) and held-out pass@1 (per evaluation) against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in train], [r["reward"] for r in train], label="train reward")
    ax.plot([r["step"] for r in train], [r["pass_rate"] for r in train], label="train pass rate",
            alpha=0.6)
    if evals:
        ax.plot([r["step"] for r in evals], [r["heldout_pass@1"] for r in evals], marker="o",
                label="held-out pass@1 (greedy)")
    ax.set_xlabel("step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("GRPO with the C++ verifier")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
