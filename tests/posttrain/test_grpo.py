"""GRPO mechanics: advantages on a known reward vector, the clipped objective and its
gradient (completion tokens only), KL 0 against the reference at the first step, rewards
from the real verifier, the held-out pass@1 estimate and its seeding, and short real runs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from megacpp.eval import Status, load_problem_set
from megacpp.infer.batch import CPP_BODY_STOP
from megacpp.infer.sampling import SamplingParams
from megacpp.posttrain.common import LoraOptions, PosttrainError, frozen_copy
from megacpp.posttrain.grpo import (
    GrpoConfig,
    PolicySampler,
    Rollout,
    group_advantages,
    grpo_objective,
    kl_k3,
    pass_at_1_estimate,
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
    """SFT the tiny model on four tasks' references until it has learned them, then GRPO on
    two of them with the other two as the held-out set: its sampled completions (engine)
    pass the real tests (g++), so reward, pass rate and the sampled held-out pass@1 are
    high, and the held-out estimate is a mean of per-problem fractions c / 4."""
    from megacpp.posttrain.common import Pair
    from megacpp.posttrain.sft import SftConfig, run_sft

    problems = load_problem_set(task_dir / "train.jsonl").problems[:4]
    pairs = [Pair(p.prompt, p.canonical_solution) for p in problems]
    run_sft(load_pretrained(base_dir).model, tokenizer, pairs, tmp_path / "sft",
            SftConfig(steps=100, batch_size=2, lr=1e-2, lora=LoraOptions(r=0)),
            base=str(base_dir))
    cfg = GrpoConfig(steps=1, tasks_per_step=2, group_size=3, max_new_tokens=32, eval_every=0,
                     eval_samples=4, eval_temperature=0.8, workers=2, lora=LoraOptions(r=4))
    run_grpo(load_pretrained(tmp_path / "sft" / "model").model, tokenizer, problems[:2],
             problems[2:], verifier, tmp_path / "grpo", cfg, base="sft")
    base_eval, record, _ = read_metrics(tmp_path / "grpo" / "metrics.jsonl")
    assert record["pass_rate"] >= 0.5 and record["reward"] >= 0.5, record
    assert record["kl"] == 0.0
    assert base_eval["kind"] == "eval" and base_eval["step"] == 0
    assert base_eval["heldout_pass@1"] >= 0.5 and base_eval["heldout_greedy_pass@1"] >= 0.5
    assert (base_eval["heldout_pass@1"] * 8).is_integer()  # (c1 / 4 + c2 / 4) / 2


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


def test_pass_at_1_estimate_and_its_standard_error_on_a_fixed_case():
    # three problems, 4 samples each: 4, 2 and 0 pass -> per problem 1, 0.5, 0
    mean, stderr = pass_at_1_estimate([(4, 4), (4, 2), (4, 0)])
    assert mean == pytest.approx(0.5)
    assert stderr == pytest.approx(0.5 / math.sqrt(3))  # sample std 0.5 over sqrt(3)
    # one greedy completion each: the binomial case, 3 of 4 pass
    mean, stderr = pass_at_1_estimate([(1, 1), (1, 0), (1, 1), (1, 1)])
    assert mean == pytest.approx(0.75) and stderr == pytest.approx(0.25)
    assert pass_at_1_estimate([(8, 3)]) == (pytest.approx(0.375), 0.0)  # one problem
    with pytest.raises(PosttrainError, match="at least one"):
        pass_at_1_estimate([])


@pytest.mark.parametrize("kwargs,needle", [
    ({"eval_samples": 0}, "--eval-samples 0: expected >= 1"),
    ({"eval_samples": 4, "eval_temperature": 0.0}, "--eval-temperature 0.0"),
    ({"eval_samples": 4, "eval_temperature": float("nan")}, "--eval-temperature nan"),
])
def test_grpo_refuses_bad_eval_options(kwargs, needle):
    with pytest.raises(PosttrainError, match=needle):
        GrpoConfig(**kwargs).check()


def test_eval_temperature_matters_only_when_sampling():
    GrpoConfig(eval_samples=1, eval_temperature=0.0).check()  # greedy: the temperature is unused


def test_heldout_samples_are_seeded_and_distinct(task_dir, tokenizer):
    """Two decodes of the same plans give the same tokens; with distinct_tasks no two sampled
    completions share a seed (a random tiny model's samples all differ)."""
    tasks = load_problem_set(task_dir / "heldout.jsonl").problems[:2]
    model = tiny_model(tokenizer)
    longest = max(len(prompt_ids(tokenizer, t.prompt)) for t in tasks)
    sampler = PolicySampler(model, tokenizer, torch.device("cpu"), 4, longest, 6)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, stop=(CPP_BODY_STOP,))
    sampled = SamplingParams(temperature=0.8, max_new_tokens=6, stop=(CPP_BODY_STOP,), seed=11)
    plans = [(1, greedy), (3, sampled)]

    def decode():
        return [[r.token_ids for r in rollouts]
                for rollouts in sampler.sample_plans(tasks, plans, distinct_tasks=True)]

    first = decode()
    assert first == decode()
    assert len(first[0]) == 2 and len(first[1]) == 6
    assert len({tuple(ids) for ids in first[1]}) == 6


@pytest.mark.parametrize("eval_samples", [1, 3])
def test_heldout_eval_records_and_receipt(task_dir, tokenizer, verifier, tmp_path, eval_samples):
    """One GRPO step with held-out evaluations at step 0 and 1: eval_samples 1 keeps the
    greedy pass@1 under its name (plus its standard error); eval_samples 3 reports the sampled
    estimate with its standard error and the greedy pass@1 beside it; the receipt carries
    the base and final values of each."""
    train = load_problem_set(task_dir / "train.jsonl").problems[:1]
    heldout = load_problem_set(task_dir / "heldout.jsonl").problems[:2]
    cfg = GrpoConfig(steps=1, tasks_per_step=1, group_size=2, max_new_tokens=4, workers=2,
                     eval_samples=eval_samples, eval_temperature=0.8, lora=LoraOptions(r=2))
    metrics = run_grpo(tiny_model(tokenizer), tokenizer, train, heldout, verifier,
                       tmp_path / "run", cfg, base="tiny")
    evals = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "eval"]
    names = {"heldout_pass@1", "heldout_pass@1_stderr"}
    if eval_samples > 1:
        names.add("heldout_greedy_pass@1")
    assert [r["step"] for r in evals] == [0, 1]
    for record in evals:
        assert set(record) == {"kind", "step", "elapsed_s", *names}
        assert 0 <= record["heldout_pass@1"] <= 1 and record["heldout_pass@1_stderr"] >= 0
    receipt = json.loads((tmp_path / "run" / "receipt.json").read_text())
    for stage, record in (("base", evals[0]), ("final", evals[-1])):
        for name in names:
            assert metrics[f"{stage}_{name}"] == record[name]
            assert receipt["metrics"][f"{stage}_{name}"] == pytest.approx(record[name])
    assert receipt["config"]["eval_samples"] == eval_samples
    assert (tmp_path / "run" / "plot.png").stat().st_size > 1000
