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
problems are evaluated and their pass@1 with its standard error over problems is logged:
one greedy completion per problem (``eval_samples`` 1), or ``eval_samples`` completions
sampled at ``eval_temperature`` with a fixed seed (the unbiased pass@1, mean over problems of
``c / n``) plus the greedy one beside it. ``plot.png`` shows reward and held-out pass@1
(with its standard-error band) against step.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from megacpp.data.tokenizer import CppTokenizer
from megacpp.eval import CppVerifier, Problem, Sample, Status, pass_at_k, verify_samples
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
EVAL_SEED_OFFSET = 5_003  # the held-out samples' seed, beside the steps' (multiples of 10_007)


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
    eval_samples: int = 1  # completions per held-out problem (1: greedy)
    eval_temperature: float = 0.8  # their sampling temperature (with eval_samples > 1)
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
        if self.eval_samples < 1:
            raise PosttrainError(f"--eval-samples {self.eval_samples}: expected >= 1 "
                                 "(1: one greedy completion per held-out problem)")
        if self.eval_samples > 1 and not (math.isfinite(self.eval_temperature)
                                          and 0 < self.eval_temperature <= 10):
            raise PosttrainError(f"--eval-temperature {self.eval_temperature}: expected a "
                                 "number in (0, 10] with --eval-samples > 1")
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


def pass_at_1_estimate(counts: Sequence[tuple[int, int]]) -> tuple[float, float]:
    """(pass@1, its standard error) over problems from ``(n, c)`` per problem: the mean of the
    unbiased per-problem estimate ``c / n`` and the sample standard deviation of those
    estimates over sqrt(problems) (0 with a single problem)."""
    per_problem = [pass_at_k(n, c, 1) for n, c in counts]
    if not per_problem:
        raise PosttrainError("pass@1 needs at least one evaluated problem")
    mean = statistics.fmean(per_problem)
    if len(per_problem) < 2:
        return mean, 0.0
    return mean, statistics.stdev(per_problem) / math.sqrt(len(per_problem))


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

    def sample(self, tasks: Sequence[Problem], n: int, params: SamplingParams) -> list[Rollout]:
        """``n`` completions of every task (task order, then sample order)."""
        return self.sample_plans(tasks, [(n, params)])[0]

    @torch.no_grad()
    def sample_plans(self, tasks: Sequence[Problem], plans: Sequence[tuple[int, SamplingParams]],
                     *, distinct_tasks: bool = False) -> list[list[Rollout]]:
        """For each plan ``(n, params)``, ``n`` completions of every task (task order, then
        sample order), all decoded in one engine batch. Sample ``j`` of task ``i`` is seeded
        ``seed + j``, or ``seed + i * n + j`` with ``distinct_tasks`` (no two completions of
        the call share random numbers)."""
        self.model.eval()
        ids = [prompt_ids(self.tokenizer, task.prompt) for task in tasks]
        requests = [BatchRequest(f"{p}/{i}/{j}", ids[i],
                                 _with_seed(params, i * n + j if distinct_tasks else j))
                    for p, (n, params) in enumerate(plans)
                    for i in range(len(tasks)) for j in range(n)]
        results = run_batch(self.engine, requests)

        def rollout(key: str, i: int) -> Rollout:
            result = results[key]
            return Rollout(tasks[i], ids[i], result.token_ids,
                           close_function_body(result.text, result.finish_reason))

        return [[rollout(f"{p}/{i}/{j}", i) for i in range(len(tasks)) for j in range(n)]
                for p, (n, _) in enumerate(plans)]


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

    def heldout_eval(self, heldout: Sequence[Problem]) -> dict[str, float]:
        """Held-out pass@1 and its standard error over problems: greedy (one completion per
        problem) with ``eval_samples`` 1; otherwise the unbiased estimate from
        ``eval_samples`` completions per problem sampled at ``eval_temperature``, with the
        greedy pass@1 beside it (decoded in the same engine batch). The samples are seeded by
        ``seed`` alone, one seed per completion: every evaluation of a run draws the same
        random numbers, and the same run evaluates the same way again."""
        cfg = self.cfg
        greedy = SamplingParams(temperature=0.0, max_new_tokens=cfg.max_new_tokens,
                                stop=(CPP_BODY_STOP,))
        plans = [(1, greedy)]
        if cfg.eval_samples > 1:
            plans.append((cfg.eval_samples, SamplingParams(
                temperature=cfg.eval_temperature, max_new_tokens=cfg.max_new_tokens,
                stop=(CPP_BODY_STOP,), seed=cfg.seed * 1_000_003 + EVAL_SEED_OFFSET)))
        sampled = self.sampler.sample_plans(heldout, plans, distinct_tasks=True)
        statuses = score(self.verifier, [r for rollouts in sampled for r in rollouts],
                         cfg.workers)
        passed = [s is Status.PASSED for s in statuses]
        greedy_passed, sampled_passed = passed[:len(heldout)], passed[len(heldout):]
        greedy_pass, greedy_stderr = pass_at_1_estimate([(1, int(p)) for p in greedy_passed])
        if cfg.eval_samples == 1:
            return {"heldout_pass@1": greedy_pass, "heldout_pass@1_stderr": greedy_stderr}
        n = cfg.eval_samples
        counts = [(n, sum(sampled_passed[i * n:(i + 1) * n])) for i in range(len(heldout))]
        pass_1, stderr = pass_at_1_estimate(counts)
        return {"heldout_pass@1": pass_1, "heldout_pass@1_stderr": stderr,
                "heldout_greedy_pass@1": greedy_pass}


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
            emit({"kind": "eval", "step": step, **run.heldout_eval(eval_set)})

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
    if evals:  # base_heldout_pass@1, final_heldout_pass@1, their _stderr, ...
        for name, record in (("base", evals[0]), ("final", evals[-1])):
            metrics.update({f"{name}_{key}": value for key, value in record.items()
                            if key.startswith("heldout_")})
    write_run_receipt(out, config, metrics, [log.path, plot, final / "config.json"])
    return metrics


def plot_grpo(records: Sequence[dict[str, Any]], path: Path) -> Path:
    """Reward (per step) and held-out pass@1 (per evaluation, with its standard-error band
    and, from sampled evaluations, the greedy pass@1 beside it) against step, as a PNG."""
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
        steps = [r["step"] for r in evals]
        pass_1 = [r["heldout_pass@1"] for r in evals]
        stderr = [r.get("heldout_pass@1_stderr", 0.0) for r in evals]
        sampled = "heldout_greedy_pass@1" in evals[0]
        line, = ax.plot(steps, pass_1, marker="o", label="held-out pass@1 (sampled)" if sampled
                        else "held-out pass@1 (greedy)")
        ax.fill_between(steps, [p - e for p, e in zip(pass_1, stderr)],
                        [p + e for p, e in zip(pass_1, stderr)], color=line.get_color(),
                        alpha=0.2, label="± standard error over problems")
        if sampled:
            ax.plot(steps, [r["heldout_greedy_pass@1"] for r in evals], marker="x",
                    linestyle="--", color=line.get_color(), alpha=0.7,
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
