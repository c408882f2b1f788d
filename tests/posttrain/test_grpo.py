"""GRPO mechanics: advantages on a known reward vector, the clipped objective and its
gradient (completion tokens only), KL 0 against the reference at the first step, rewards
from the real verifier, and a short real run on two tasks."""

from __future__ import annotations

import json

import pytest
import torch

from megacpp.eval import Status, load_problem_set
from megacpp.posttrain.common import LoraOptions, PosttrainError, frozen_copy
from megacpp.posttrain.grpo import (
    GrpoConfig,
    Rollout,
    group_advantages,
    grpo_objective,
    kl_k3,
    prompt_ids,
    reward_of,
    run_grpo,
    score,
    token_logprobs,
)
from megacpp.posttrain.sft import completion_batch
from megacpp.pretrained import load_pretrained
from megacpp.train.metrics import read_metrics
from tests.posttrain.conftest import tiny_model


def test_group_advantages_on_a_known_reward_vector():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.1, 0.0, 1.0]])
    adv = group_advantages(rewards)
    # group 0: mean 0.5, unbiased std sqrt(1/3)
    expected0 = 0.5 / (3 ** -0.5 + 1e-4)
    torch.testing.assert_close(adv[0], torch.tensor([expected0, -expected0, -expected0,
                                                     expected0]))
    assert (adv[1] == 0).all()  # equal rewards teach nothing
    r = rewards[2]
    torch.testing.assert_close(adv[2], (r - r.mean()) / (r.std() + 1e-4))
    assert abs(adv[2].sum().item()) < 1e-5


def test_objective_value_clipping_kl_and_gradient_mask():
    torch.manual_seed(0)
    logp = (-torch.rand(3, 5)).requires_grad_(True)
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([1.0, -0.5, 2.0])
    # on-policy, policy == reference: ratio 1, KL 0, loss = -sum(advantages)
    loss, stats = grpo_objective(logp, logp.detach(), logp.detach(), adv, mask, 0.2, 0.1)
    torch.testing.assert_close(loss, -adv.sum())
    assert (stats["kl"] == 0).all() and (stats["clipped"] == 0).all()
    loss.backward()
    assert (logp.grad[~mask] == 0).all() and (logp.grad[mask] != 0).all()
    # d loss / d logp_t = -A / tokens on each completion token
    torch.testing.assert_close(logp.grad[0, 2:], torch.full((3,), -1.0 / 3))
    # a ratio above 1 + eps with a positive advantage is clipped: no policy gradient there
    logp.grad = None
    old = logp.detach() - 0.5  # ratio e^0.5 > 1.2
    loss, stats = grpo_objective(logp, old, logp.detach(), adv, mask, 0.2, 0.0)
    loss.backward()
    assert (logp.grad[0] == 0).all() and (logp.grad[2] == 0).all()
    assert (logp.grad[1][mask[1]] != 0).all()  # negative advantage: min keeps the ratio term
    assert (stats["clipped"] == 1).all()
    # k3 is >= 0 and 0 only where the log-probs agree
    d = torch.linspace(-2, 2, 9)
    assert (kl_k3(torch.zeros(9), d) >= 0).all() and kl_k3(torch.zeros(1), torch.zeros(1)) == 0


def test_rewards_come_from_the_real_verifier(task_dir, tokenizer, verifier):
    problem = load_problem_set(task_dir / "train.jsonl").problems[0]
    ids = prompt_ids(tokenizer, problem.prompt)
    completions = [problem.canonical_solution, "    return 0;\n}\n", "    return x +;\n}\n"]
    rollouts = [Rollout(problem, ids, [], text) for text in completions]
    statuses = score(verifier, rollouts, workers=2)
    assert statuses == [Status.PASSED, Status.FAILED, Status.COMPILE_ERROR]
    assert [reward_of(s, 0.1) for s in statuses] == [1.0, 0.1, 0.0]
    assert [reward_of(s, 0.0) for s in statuses] == [1.0, 0.0, 0.0]


def test_policy_update_moves_logprobs_with_the_advantage(tokenizer, task_dir):
    """One clipped update on two fixed completions: the one with the positive advantage
    becomes more likely, the other less; the frozen reference does not move."""
    from megacpp.posttrain.common import make_policy
    from megacpp.posttrain.grpo import GrpoRun

    problem = load_problem_set(task_dir / "train.jsonl").problems[0]
    model = tiny_model(tokenizer)
    reference = frozen_copy(model)
    make_policy(model, LoraOptions(r=0))
    params = [p for p in model.parameters() if p.requires_grad]
    cfg = GrpoConfig(lr=3e-3, kl_coef=0.0, group_size=2)
    ids = prompt_ids(tokenizer, problem.prompt)
    good = tokenizer.encode(problem.canonical_solution).tolist()
    bad = tokenizer.encode("    return 0;\n}\n").tolist()
    rollouts = [Rollout(problem, ids, good, ""), Rollout(problem, ids, bad, "")]
    x, y = completion_batch([(ids + r.token_ids, len(ids)) for r in rollouts], tokenizer.pad_id)

    def seq_logprob(m):
        with torch.no_grad():
            return token_logprobs(m, x, y).sum(1)

    before, ref_before = seq_logprob(model), seq_logprob(reference)
    run = GrpoRun(model, reference, tokenizer, None, cfg, torch.device("cpu"), None,
                  torch.optim.AdamW(params, lr=cfg.lr), params, None)
    stats = run.update(rollouts, torch.tensor([1.0, -1.0]))
    after = seq_logprob(model)
    assert after[0] > before[0] and after[1] < before[1]
    assert stats["kl"] == 0.0  # the first pass sees the policy before its update
    torch.testing.assert_close(seq_logprob(reference), ref_before)


@pytest.mark.slow
def test_grpo_runs_on_two_tasks_with_real_rewards(task_dir, tokenizer, base_dir, verifier,
                                                  tmp_path):
    """3 LoRA GRPO steps on 2 tasks, sampling through the engine and scoring with g++: KL is 0
    at the first step (policy == reference), every record is logged, the outputs load."""
    problems = load_problem_set(task_dir / "train.jsonl").problems[:2]
    heldout = load_problem_set(task_dir / "heldout.jsonl").problems[:1]
    cfg = GrpoConfig(steps=3, tasks_per_step=2, group_size=3, max_new_tokens=24,
                     temperature=1.0, eval_every=0, workers=2, compile_credit=0.1,
                     lora=LoraOptions(r=4))
    model = load_pretrained(base_dir).model
    metrics = run_grpo(model, tokenizer, problems, heldout, verifier, tmp_path / "run", cfg,
                       base=str(base_dir))
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [1, 2, 3] and [r["step"] for r in evals] == [0, 3]
    assert train[0]["kl"] == 0.0
    for r in train:
        assert 0 <= r["pass_rate"] <= r["compile_rate"] <= 1 and 0 <= r["reward"] <= 1
        assert r["completion_tokens"] > 0 and r["verify_s"] > 0
    assert metrics["base_heldout_pass@1"] == evals[0]["heldout_pass@1"]
    receipt = json.loads((tmp_path / "run" / "receipt.json").read_text())
    assert receipt["kind"] == "train" and receipt["config"]["posttrain"] == "grpo"
    assert (tmp_path / "run" / "plot.png").stat().st_size > 1000
    load_pretrained(tmp_path / "run" / "model")


def test_grpo_refuses_bad_config_and_eval_only_problems(tokenizer, verifier, tmp_path):
    from megacpp.eval.problems import load_problems

    with pytest.raises(PosttrainError, match="--group-size 1"):
        GrpoConfig(group_size=1).check()
    with pytest.raises(PosttrainError, match="--clip-eps"):
        GrpoConfig(clip_eps=0).check()
    humaneval = load_problems()[:2]
    with pytest.raises(PosttrainError, match="HumanEval-X"):
        run_grpo(tiny_model(tokenizer), tokenizer, humaneval, [], verifier, tmp_path / "r",
                 GrpoConfig(steps=1, group_size=2), base="x")
    assert not (tmp_path / "r").exists()


def test_grpo_refuses_a_heldout_set_that_overlaps_training(tokenizer, verifier, task_dir,
                                                           tmp_path):
    from megacpp.eval.problems import load_problem_set

    train = load_problem_set(task_dir / "train.jsonl").problems
    with pytest.raises(PosttrainError, match="share 1 prompt"):
        run_grpo(tiny_model(tokenizer), tokenizer, train, [train[0]], verifier, tmp_path / "r",
                 GrpoConfig(steps=1, group_size=2), base="x")
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_a_model_that_learned_the_tasks_earns_reward(task_dir, tokenizer, base_dir, verifier,
                                                     tmp_path):
    """SFT the tiny model on two tasks' references until it has learned them, then GRPO:
    its sampled completions (engine) pass the real tests (g++), so reward and pass rate are
    high."""
    from megacpp.posttrain.common import Pair
    from megacpp.posttrain.sft import SftConfig, run_sft

    problems = load_problem_set(task_dir / "train.jsonl").problems[:2]
    pairs = [Pair(p.prompt, p.canonical_solution) for p in problems]
    run_sft(load_pretrained(base_dir).model, tokenizer, pairs, tmp_path / "sft",
            SftConfig(steps=100, batch_size=2, lr=1e-2, lora=LoraOptions(r=0)),
            base=str(base_dir))
    cfg = GrpoConfig(steps=1, tasks_per_step=2, group_size=3, max_new_tokens=32, eval_every=0,
                     workers=2, lora=LoraOptions(r=4))
    run_grpo(load_pretrained(tmp_path / "sft" / "model").model, tokenizer, problems, [],
             verifier, tmp_path / "grpo", cfg, base="sft")
    (record,) = read_metrics(tmp_path / "grpo" / "metrics.jsonl")
    assert record["pass_rate"] >= 0.5 and record["reward"] >= 0.5, record
    assert record["kl"] == 0.0


def test_time_budget_ends_the_run_after_the_step_that_passes_it(task_dir, tokenizer, verifier,
                                                                tmp_path):
    problems = load_problem_set(task_dir / "train.jsonl").problems[:1]
    cfg = GrpoConfig(steps=50, tasks_per_step=1, group_size=2, max_new_tokens=4,
                     time_budget_s=1e-3, workers=1, lora=LoraOptions(r=2))
    metrics = run_grpo(tiny_model(tokenizer), tokenizer, problems, [], verifier,
                       tmp_path / "run", cfg, base="tiny")
    assert metrics["steps"] == 1.0
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1]
    assert (tmp_path / "run" / "checkpoints" / "step_000001" / "config.json").is_file()
