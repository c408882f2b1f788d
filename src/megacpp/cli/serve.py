"""``megacpp serve``: the OpenAI-compatible HTTP server over one or more checkpoints.

    megacpp serve --checkpoint runs/a [--checkpoint NAME=DIR ...] [--router router.json]
                  [--host 127.0.0.1 --port 8000] [engine options]
    megacpp serve router-train --source NAME=DIR --source NAME=DIR --out router.json

Each ``--checkpoint`` is one specialist, named ``NAME`` (default: its run directory's name);
requests choose it with ``"model": NAME``, or ``"model": "auto"`` with a router model that
``router-train`` made from each specialist's corpus (see :mod:`megacpp.infer.router`).
"""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Annotated

import typer

from megacpp.cli._options import DeviceOpt, FallbackOpt, resolve_device
from megacpp.errors import MegaCppError

app = typer.Typer(add_completion=False, no_args_is_help=False)

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


def split_named(value: str, what: str) -> tuple[str | None, Path]:
    """``NAME=PATH`` -> (NAME, PATH); a plain ``PATH`` -> (None, PATH)."""
    name, sep, rest = value.partition("=")
    if sep and _NAME.match(name) and rest:
        return name, Path(rest)
    if sep and not Path(value).exists():
        raise MegaCppError(f"{what} {value!r}: expected NAME=PATH with NAME made of letters, "
                           "digits, '_', '.', '-' (or a plain PATH)")
    return None, Path(value)


@app.callback(invoke_without_command=True)
def serve(
    ctx: typer.Context,
    checkpoint: Annotated[list[str] | None, typer.Option(
        help="[NAME=]DIR: a run directory or checkpoints/step_N (repeatable: specialists).")] = None,
    tokenizer: Annotated[Path | None, typer.Option(
        help="tokenizer.json for every checkpoint (default: each checkpoint's own).")] = None,
    router: Annotated[Path | None, typer.Option(
        help="Router model JSON (from `megacpp serve router-train`) for model 'auto'.")] = None,
    lora: Annotated[list[str] | None, typer.Option(
        help="NAME=DIR: a LoRA adapter (peft format) over the first --checkpoint, served as "
             "model NAME (repeatable).")] = None,
    runtime_lora: Annotated[bool, typer.Option(
        "--runtime-lora", help="Allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                               "(adapters from paths on this machine, named by clients).")] = False,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0: any free port; the URL is printed).")] = 8000,
    max_num_seqs: Annotated[int, typer.Option(help="Sequences decoded together at most.")] = 32,
    block_size: Annotated[int, typer.Option(help="Tokens per KV-cache block.")] = 16,
    num_blocks: Annotated[int | None, typer.Option(
        help="KV blocks per attention layer (default: max-num-seqs x max-model-len).")] = None,
    max_model_len: Annotated[int, typer.Option(help="Prompt + completion tokens at most.")] = 2048,
    prefill_chunk: Annotated[int, typer.Option(help="Prompt tokens prefilled per step.")] = 2048,
    max_waiting: Annotated[int, typer.Option(
        help="Waiting-queue bound; beyond it requests get HTTP 429.")] = 256,
    prefill_graphs: Annotated[bool, typer.Option(
        help="On CUDA: replay prefill chunks as captured CUDA graphs: first chunks per "
             "(batch, length) bucket, later chunks per (batch, length, width) bucket.")] = True,
    speculative_tokens: Annotated[int, typer.Option(
        help="Greedy requests: tokens the model's MTP head drafts per step, verified by the "
             "model (0: off; needs [model.mtp] depth >= 1).")] = 0,
    prefix_cache: Annotated[bool, typer.Option(
        "--prefix-cache/--no-prefix-cache",
        help="Reuse the KV blocks and M/R state snapshots of prompts that share a prefix.")] = True,
    prefix_snapshots: Annotated[int | None, typer.Option(
        help="M/R state snapshots the prefix cache keeps (default: 2 x max-num-seqs).")] = None,
    snapshot_interval: Annotated[int, typer.Option(
        help="Tokens between M/R state snapshots in a long prompt (whole blocks).")] = 512,
    device: DeviceOpt = "auto",
    fallback_to_previous: FallbackOpt = False,
    dtype: Annotated[str | None, typer.Option(
        help="float32, bfloat16 or float16 (default: bfloat16 on cuda, float32 on cpu).")] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
    kernels: Annotated[str, typer.Option(
        help="Kernel mode: auto (the catalog's chosen backends where they qualify, else the "
             "reference), fast (fail if none qualifies) or reference.")] = "auto",
) -> None:
    """Serve checkpoints over an OpenAI-compatible HTTP API: /v1/completions,
    /v1/chat/completions, /v1/models, /health, /metrics."""
    if ctx.invoked_subcommand is not None:
        return
    if not checkpoint:
        raise MegaCppError("give at least one --checkpoint [NAME=]DIR")
    import torch

    from megacpp.infer.engine import EngineConfig

    device = resolve_device(device)
    default_dtype = "float32" if device == "cpu" else "bfloat16"
    dtype_name = DTYPES.get((dtype or default_dtype).lower())
    if dtype_name is None:
        raise MegaCppError(f"--dtype {dtype!r}: choose one of float32, bfloat16, float16")
    from megacpp.kernels.runtime import KERNEL_MODES, set_kernel_mode

    if kernels not in KERNEL_MODES:
        raise MegaCppError(f"--kernels {kernels!r}: choose one of {', '.join(KERNEL_MODES)}")
    config = EngineConfig(max_num_seqs=max_num_seqs, block_size=block_size, num_blocks=num_blocks,
                          max_model_len=max_model_len, prefill_chunk=prefill_chunk,
                          max_waiting=max_waiting, prefill_graphs=prefill_graphs,
                          speculative_tokens=speculative_tokens,
                          prefix_cache=prefix_cache, prefix_snapshots=prefix_snapshots,
                          snapshot_interval=snapshot_interval)
    named = [split_named(value, "--checkpoint") for value in checkpoint]
    adapters_named = _adapter_options(lora or [])
    classifier = _load_router(router)
    sock = _bind(host, port)  # before loading: a taken port fails fast
    set_kernel_mode(kernels)  # process-wide; reset when serving ends (in-process callers)
    try:
        loaded = [_load_specialist(name, path, tokenizer, device, getattr(torch, dtype_name),
                                   config, fallback_to_previous, keep_state=i == 0 and (
                                       bool(adapters_named) or runtime_lora))
                  for i, (name, path) in enumerate(named)]
        specialists = [spec for spec, _ in loaded]
        adapters = None
        if adapters_named or runtime_lora:
            adapters = _load_adapters(specialists[0], loaded[0][1], adapters_named, runtime_lora)
            specialists += [adapters.build(name, path) for name, path in adapters_named]
        _run(specialists, classifier, sock, log_level, adapters)
    finally:
        set_kernel_mode(None)


def _load_router(path: Path | None):
    if path is None:
        return None
    from megacpp.infer.router import SnippetClassifier

    return SnippetClassifier.load(path)


def _adapter_options(values: list[str]) -> list[tuple[str, Path]]:
    named = []
    for value in values:
        name, path = split_named(value, "--lora")
        if name is None:
            raise MegaCppError(f"--lora {value!r}: expected NAME=DIR (the model name requests "
                               "use, and the adapter directory)")
        if not (path / "adapter_config.json").is_file():
            raise MegaCppError(f"--lora {name}: {path} is not a LoRA adapter directory (no "
                               "adapter_config.json)")
        if name in (n for n, _ in named):
            raise MegaCppError(f"--lora {name} given twice")
        named.append((name, path))
    return named


def _load_adapters(base, state, named, runtime):
    """The adapter set over the first checkpoint (``state``: its weights before the engine
    cast them); every --lora adapter is checked against it here, before serving starts."""
    from megacpp.infer.adapters import AdapterSet

    adapters = AdapterSet.of(base, state, runtime)
    for name, path in named:
        if name == base.name:
            raise MegaCppError(f"--lora {name}: the checkpoint is already served under that name")
        adapters.loaded[name] = str(path)
    return adapters


def _load_specialist(name, path, tokenizer, device, dtype, config, fallback_to_previous=False,
                     keep_state=False):
    from megacpp.cli._checkpoint import load_for_inference
    from megacpp.infer.async_engine import AsyncEngine
    from megacpp.infer.engine import Engine
    from megacpp.infer.server import Specialist

    if name is None:  # the run directory's name
        resolved = Path(path).resolve()
        name = resolved.parent.parent.name if resolved.parent.name == "checkpoints" \
            else resolved.name
    model, tok, ckpt = load_for_inference(path, tokenizer, device, fallback_to_previous)
    # float32 weights on the CPU, before the engine casts the model: LoRA adapters merge here
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()} \
        if keep_state else None
    engine = Engine(model, tok, config, device=device, dtype=dtype)
    spec = (f", speculative decoding: {config.speculative_tokens} MTP drafts per step"
            if config.speculative_tokens else "")
    typer.echo(f"loaded {name}: {ckpt} ({sum(p.numel() for p in model.parameters()):,} "
               f"parameters, {config.total_blocks} KV blocks x {config.block_size} tokens, "
               f"{config.max_num_seqs} slots, prefix cache "
               f"{'on' if config.prefix_cache else 'off'}{spec})")
    return Specialist(name, AsyncEngine(engine, name), tok, config.max_model_len, str(ckpt)), state


def _bind(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise MegaCppError(f"--port {port}: must be in 0..65535")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        raise MegaCppError(f"cannot listen on {host}:{port}: {exc}") from None
    return sock


def _run(specialists, classifier, sock: socket.socket, log_level: str, adapters=None) -> None:
    import uvicorn

    from megacpp.infer.server import create_app

    application = create_app(specialists, classifier, adapters)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    names = ", ".join(s.name for s in specialists) + (" (+ auto)" if classifier else "")
    typer.echo(f"serving {names} on http://{shown}:{port}")
    config = uvicorn.Config(application, log_level=log_level, timeout_graceful_shutdown=5)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:  # SIGINT / SIGTERM
            application.state.server.abort_all()  # running streams end with "abort", [DONE]
            super().handle_exit(sig, frame)

    try:
        Server(config).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    typer.echo("stopped")


@app.command("router-train")
def router_train(
    source: Annotated[list[str], typer.Option(
        help="NAME=PATH: a specialist's corpus (a megacpp dataset or a C/C++ source dir).")],
    out: Annotated[Path, typer.Option(help="Where to write the router model JSON.")],
    snippet_lines: Annotated[int, typer.Option(help="Lines per training snippet.")] = 30,
    max_features: Annotated[int, typer.Option(help="Most frequent features kept.")] = 50_000,
    alpha: Annotated[float, typer.Option(help="Additive (Laplace) smoothing.")] = 1.0,
) -> None:
    """Train the `auto` router: naive Bayes over C++ tokens, labelled by corpus source."""
    from megacpp.infer.router import train_router

    sources: dict[str, Path] = {}
    for value in source:
        name, path = split_named(value, "--source")
        if name is None:
            raise MegaCppError(f"--source {value!r}: expected NAME=PATH")
        if name in sources:
            raise MegaCppError(f"--source {name} given twice")
        if not path.exists():
            raise MegaCppError(f"--source {name}: {path} does not exist")
        sources[name] = path
    if len(sources) < 2:
        raise MegaCppError("the router needs at least two --source NAME=PATH")
    clf = train_router(sources, snippet_lines=snippet_lines, max_features=max_features,
                       alpha=alpha)
    clf.save(out)
    meta = clf.meta
    counts = ", ".join(f"{k}: {v}" for k, v in meta["snippets"].items())
    typer.echo(f"router: {len(clf.vocab)} features, training snippets {counts}; held-out "
               f"accuracy {meta['heldout_accuracy']:.3f} on {meta['heldout_snippets']} snippets")
    typer.echo(f"wrote {out}")
