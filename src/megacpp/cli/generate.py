"""``megacpp generate``: sample completions from a trained checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.panel import Panel
from rich.syntax import Syntax

from megacpp._io import TEXT_LIMIT, read_text_bounded
from megacpp.cli._options import DeviceOpt, FallbackOpt, TokenizerOpt, resolve_device, utf8_text
from megacpp.errors import MegaCppError

app = typer.Typer(add_completion=False)


@app.command()
def generate(
    checkpoint: Annotated[Path, typer.Option(help="Run directory or checkpoints/step_N directory.")],
    prompt: Annotated[str | None, typer.Option(help="Prompt text.")] = None,
    file: Annotated[Path | None, typer.Option(help="Read the prompt from this file.")] = None,
    n: Annotated[int, typer.Option(help="Completions to sample.")] = 1,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per completion at most.")] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.8,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass (1 = off).")] = 0.95,
    top_k: Annotated[int, typer.Option(help="Keep the k most likely tokens (0 = off).")] = 0,
    seed: Annotated[int | None, typer.Option(help="Seed for reproducible samples.")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop sequence (repeatable).")] = None,
    function_body: Annotated[bool, typer.Option(
        "--function-body", help="Complete a C++ function body: stop at its closing brace.")] = False,
    tokenizer: TokenizerOpt = None,
    speculative_tokens: Annotated[int, typer.Option(
        help="Greedy (--temperature 0): tokens the model's MTP head drafts per step, verified "
             "by the model (0: off; needs [model.mtp] depth >= 1).")] = 0,
    device: DeviceOpt = "auto",
    fallback_to_previous: FallbackOpt = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON lines.")] = False,
) -> None:
    """Sample ``n`` completions of a prompt with the model's cached decoding."""
    from megacpp.cli._checkpoint import load_for_inference
    from megacpp.infer.generate import CPP_BODY_STOP, MAX_COMPLETIONS, TextGenerator
    from megacpp.infer.sampling import SamplingParams

    if (prompt is None) == (file is None):
        raise MegaCppError("give exactly one of --prompt TEXT or --file F")
    if file is not None:
        prompt = read_text_bounded(file, TEXT_LIMIT, what="prompt file")
    prompt = utf8_text(prompt, "--prompt")
    if not 1 <= n <= MAX_COMPLETIONS:
        raise MegaCppError(f"--n must be in 1..{MAX_COMPLETIONS}, got {n}")
    stops = tuple(utf8_text(s, "--stop") for s in stop or ()) + (
        (CPP_BODY_STOP,) if function_body else ())
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                            max_new_tokens=max_new_tokens, stop=stops, seed=seed)
    if speculative_tokens and temperature != 0:
        raise MegaCppError(f"--speculative-tokens {speculative_tokens} drafts for greedy decoding "
                           "only: add --temperature 0 (or drop --speculative-tokens)")
    device = resolve_device(device)
    model, tok, ckpt = load_for_inference(checkpoint, tokenizer, device,
                                          fallback_to_previous=fallback_to_previous)
    generator = TextGenerator(model, tok, device, speculative_tokens=speculative_tokens)
    completions = generator.complete(prompt, n, params)
    console = Console()
    for i, c in enumerate(completions):
        text = c.text + (CPP_BODY_STOP + "\n" if function_body and c.stop == CPP_BODY_STOP else "")
        if as_json:
            typer.echo(json.dumps({"index": i, "completion": text, "finish_reason": c.finish_reason,
                                   "tokens": len(c.token_ids), "checkpoint": str(ckpt)}))
        else:
            console.print(Panel(Syntax(prompt + text, "cpp", theme="ansi_dark"),
                                title=f"#{i} ({c.finish_reason}, {len(c.token_ids)} tokens)",
                                title_align="left"))
