"""``megacpp posttrain ...``: post-training with the verifier.

Commands: ``tasks`` (write the generated C++ task set, train and held-out), ``sft``
(supervised fine-tuning on prompt/completion JSONL, completion-only loss, LoRA or full) and
``grpo`` (GRPO with the sandboxed verifier as the reward).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from megacpp.cli._options import DeviceOpt, resolve_device

app = typer.Typer(add_completion=False, no_args_is_help=True)
console = Console(highlight=False)

BaseOpt = Annotated[Path, typer.Option(
    "--base", help="The starting model: a run directory, a checkpoint directory or a "
                   "megacpp export hf directory (a posttrain run's checkpoints/step_N or model/).")]
OutOpt = Annotated[Path, typer.Option("--out", help="Run directory to write (new or empty).")]
LoraROpt = Annotated[int, typer.Option(
    "--lora-r", help="LoRA rank (peft); 0 = full fine-tuning of every parameter.")]
LoraAlphaOpt = Annotated[float, typer.Option("--lora-alpha", help="LoRA alpha.")]
LoraTargetOpt = Annotated[list[str] | None, typer.Option(
    "--lora-target", help="Linear layers to adapt (repeatable; names or globs as [lora] "
                          "targets; default: every linear layer LoRA can adapt).")]
SeedOpt = Annotated[int, typer.Option(help="Seed (data order, sampling, initialization).")]
ProgressOpt = Annotated[bool, typer.Option("--progress/--no-progress",
                                           help="Show a progress bar.")]


@app.command()
def tasks(
    out: OutOpt,
    seed: SeedOpt = 0,
    heldout_fraction: Annotated[float, typer.Option(
        help="Share of each family's variants held out.")] = 0.25,
    per_family: Annotated[int | None, typer.Option(
        help="Variants per family at most (a seeded sample; default: all).")] = None,
    family: Annotated[list[str] | None, typer.Option(
        "--family", help="Only this family (repeatable).")] = None,
) -> None:
    """Write the generated C++ task set: train.jsonl, heldout.jsonl (HumanEval-X layout, with
    suite sidecars), train.sft.jsonl and manifest.json."""
    from megacpp.posttrain.tasks import write_task_set

    manifest = write_task_set(out, seed, heldout_fraction, per_family, tuple(family or ()))
    counts = manifest["counts"]
    console.print(f"wrote {counts['train']} train and {counts['heldout']} held-out problems "
                  f"from {len(manifest['families'])} families to {out}")


@app.command()
def sft(
    base: BaseOpt,
    data: Annotated[Path, typer.Option(
        "--data", help='JSONL of {"prompt": ..., "completion": ...} (e.g. train.sft.jsonl).')],
    out: OutOpt,
    steps: Annotated[int, typer.Option(help="Optimizer steps.")] = 100,
    batch_size: Annotated[int, typer.Option(help="Pairs per step.")] = 8,
    lr: Annotated[float, typer.Option(help="AdamW learning rate.")] = 2e-4,
    max_len: Annotated[int, typer.Option(help="Tokens per pair at most.")] = 1024,
    save_every: Annotated[int, typer.Option(help="Checkpoint every N steps (0: at the end).")] = 0,
    lora_r: LoraROpt = 8,
    lora_alpha: LoraAlphaOpt = 16.0,
    lora_target: LoraTargetOpt = None,
    seed: SeedOpt = 0,
    device: DeviceOpt = "auto",
    progress: ProgressOpt = True,
) -> None:
    """Supervised fine-tuning with the loss on completion tokens only."""
    from megacpp.posttrain.common import LoraOptions, read_pairs
    from megacpp.posttrain.sft import SftConfig, run_sft
    from megacpp.pretrained import load_pretrained

    cfg = SftConfig(steps=steps, batch_size=batch_size, lr=lr, max_len=max_len, seed=seed,
                    save_every=save_every,
                    lora=LoraOptions(r=lora_r, alpha=lora_alpha, targets=tuple(lora_target or ())))
    cfg.check()
    pairs = read_pairs(data)
    device = resolve_device(device)
    loaded = load_pretrained(base, device)
    with _progress(progress, "sft", steps) as tick:
        metrics = run_sft(loaded.model, loaded.tokenizer, pairs, out, cfg, base=str(base),
                          device=device, on_step=lambda r: tick(f"loss {r['loss']:.4f}"))
    console.print(f"loss {metrics['first_loss']:.4f} -> {metrics['final_loss']:.4f} in "
                  f"{steps} steps; wrote {out}/model, {out}/metrics.jsonl, {out}/receipt.json")


@app.command()
def grpo(
    base: BaseOpt,
    train: Annotated[Path, typer.Option(
        "--train", help="Training problem set (.jsonl, e.g. train.jsonl of posttrain tasks).")],
    out: OutOpt,
    heldout: Annotated[Path | None, typer.Option(
        "--heldout", help="Held-out problem set: pass@1 at step 0, every --eval-every "
                          "steps and at the end.")] = None,
    steps: Annotated[int, typer.Option(help="GRPO steps.")] = 50,
    tasks_per_step: Annotated[int, typer.Option(help="Problems per step.")] = 8,
    group_size: Annotated[int, typer.Option(help="Completions sampled per problem.")] = 8,
    temperature: Annotated[float, typer.Option(help="Sampling temperature.")] = 1.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.")] = 1.0,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per completion at most.")] = 192,
    lr: Annotated[float, typer.Option(help="AdamW learning rate.")] = 1e-4,
    clip_eps: Annotated[float, typer.Option(help="PPO ratio clipping epsilon.")] = 0.2,
    kl_coef: Annotated[float, typer.Option(help="KL penalty to the reference model.")] = 0.04,
    inner_steps: Annotated[int, typer.Option(
        help="Optimizer steps per batch of samples (>1: the ratio and clipping matter).")] = 1,
    compile_credit: Annotated[float, typer.Option(
        help="Reward of a completion that compiles but fails its tests.")] = 0.0,
    micro_batch: Annotated[int, typer.Option(help="Completions per forward/backward.")] = 16,
    eval_every: Annotated[int, typer.Option(help="Held-out pass@1 every N steps.")] = 10,
    eval_limit: Annotated[int | None, typer.Option(
        help="Held-out problems evaluated at most.")] = None,
    eval_samples: Annotated[int, typer.Option(
        help="Completions per held-out problem: 1 is greedy; N > 1 samples N at "
             "--eval-temperature for an unbiased pass@1 (the greedy one is kept beside "
             "it).")] = 1,
    eval_temperature: Annotated[float, typer.Option(
        help="Sampling temperature of the held-out completions (with --eval-samples > 1)."
    )] = 0.8,
    save_every: Annotated[int, typer.Option(help="Checkpoint every N steps (0: at the end).")] = 0,
    time_budget_s: Annotated[float, typer.Option(
        help="Stop after the step that passes this many seconds of GRPO (0: run --steps); "
             "the held-out evaluation and checkpoint follow.")] = 0.0,
    workers: Annotated[int, typer.Option(help="Parallel compile+run workers.")] = 4,
    isolation: Annotated[str | None, typer.Option(
        help="Sandbox isolation: namespaces (default) or rlimits.")] = None,
    lora_r: LoraROpt = 16,
    lora_alpha: LoraAlphaOpt = 32.0,
    lora_target: LoraTargetOpt = None,
    seed: SeedOpt = 0,
    device: DeviceOpt = "auto",
    progress: ProgressOpt = True,
) -> None:
    """GRPO: group sampling through the engine, rewards from the sandboxed verifier."""
    from megacpp.eval import CppVerifier, Sandbox, load_problem_set
    from megacpp.posttrain.common import LoraOptions
    from megacpp.posttrain.grpo import GrpoConfig, run_grpo
    from megacpp.pretrained import load_pretrained

    cfg = GrpoConfig(steps=steps, tasks_per_step=tasks_per_step, group_size=group_size,
                     temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, lr=lr,
                     clip_eps=clip_eps, kl_coef=kl_coef, inner_steps=inner_steps,
                     compile_credit=compile_credit, micro_batch=micro_batch,
                     eval_every=eval_every, eval_limit=eval_limit, eval_samples=eval_samples,
                     eval_temperature=eval_temperature, save_every=save_every,
                     time_budget_s=time_budget_s, seed=seed, workers=workers,
                     lora=LoraOptions(r=lora_r, alpha=lora_alpha, targets=tuple(lora_target or ())))
    cfg.check()
    train_set = load_problem_set(train)
    heldout_set = load_problem_set(heldout) if heldout is not None else None
    sandbox = Sandbox(isolation)
    verifier = CppVerifier(train_set.suite.build_options(), sandbox)
    train_set.suite.check_toolchain(verifier)
    device = resolve_device(device)
    loaded = load_pretrained(base, device)
    with _progress(progress, "grpo", steps) as tick:
        def on_record(record: dict[str, Any]) -> None:
            if record["kind"] == "train":
                tick(f"reward {record['reward']:.3f} kl {record['kl']:.4f}")
            else:
                greedy = record.get("heldout_greedy_pass@1")
                console.print(f"step {record['step']}: held-out pass@1 "
                              f"{record['heldout_pass@1']:.3f} "
                              f"± {record['heldout_pass@1_stderr']:.3f}"
                              + ("" if greedy is None else f" (greedy {greedy:.3f})"))

        metrics = run_grpo(loaded.model, loaded.tokenizer, train_set.problems,
                           heldout_set.problems if heldout_set else [], verifier, out, cfg,
                           base=str(base), device=device, on_record=on_record)
    console.print(json.dumps({k: round(v, 4) for k, v in metrics.items()}))
    console.print(f"wrote {out}/model, {out}/metrics.jsonl, {out}/plot.png, {out}/receipt.json")


class _progress:
    """A rich progress bar over ``total`` steps (or nothing with --no-progress); ``tick(text)``
    advances it by one step."""

    def __init__(self, enabled: bool, what: str, total: int) -> None:
        self.enabled, self.what, self.total = enabled, what, total
        self.bar: Progress | None = None

    def __enter__(self):
        if not self.enabled:
            return lambda text: None
        self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                            MofNCompleteColumn(), TimeElapsedColumn(),
                            TextColumn("{task.fields[status]}"), console=Console(stderr=True))
        self.bar.__enter__()
        task = self.bar.add_task(self.what, total=self.total, status="")
        return lambda text: self.bar.update(task, advance=1, status=text)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)
