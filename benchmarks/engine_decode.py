"""Decode throughput of the serving engine (megacpp.infer.engine) on one GPU, per decode mode.

Run (on a GPU machine)::

    PYTHONPATH=src python benchmarks/engine_decode.py --config nam56r-350m \\
        --batch 1 16 64 --modes eager graphs compile --profile --hf-baseline

(``compile`` = ``EngineConfig(compile_decode=True)``: slow first steps while inductor
compiles.) It writes ``engine_decode.json`` (rewritten after every row) and ``command.txt`` to
``--out`` (default ``benchmarks/results/engine_decode/<device>``).

Per (mode, batch B): B requests of ``--prompt-len`` random token ids (random-init model,
bf16, greedy, ``ignore_eos``) are prefilled, then ``--steps`` engine steps are timed; each
step decodes one token for all B rows. Reported:

* ``step_ms`` / ``tokens_per_s``: wall-clock per ``Engine.step()`` (scheduling, input
  staging, the forward, sampling, detokenization, stop checks) and B / step time;
* ``forward_ms``: the decode forward alone (CUDA events; graph replay in ``graphs`` mode).

``--profile`` adds the top CUDA kernels of one eager decode forward at the largest batch;
``--hf-baseline`` adds ``transformers`` generate of a ~350M Llama, for context.
This measures the engine alone (no HTTP); the end-to-end serving benchmark against
``transformers`` is the server's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from megacpp.data.tokenizer import CppTokenizer, train_tokenizer
from megacpp.infer.engine import Engine, EngineConfig
from megacpp.infer.graphs import DecodeGraphs, compiled_decode_fn
from megacpp.infer.sampling import SamplingParams
from megacpp.kernels.profiling import device_rows
from megacpp.model.cache import PagedBatch
from megacpp.model.config import load_config
from megacpp.model.model import HybridLM

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tokenizer() -> CppTokenizer:
    """A small tokenizer (decoding only; ids past its vocabulary decode to nothing)."""
    texts = [p.read_text(encoding="utf-8") for p in sorted((ROOT / "src").rglob("*.py"))]
    return CppTokenizer.from_hf(train_tokenizer(texts, vocab_size=600))


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def cuda_ms(fn, iters: int) -> float:
    if not torch.cuda.is_available():  # CPU smoke runs of this script
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) * 1000 / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    sync()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    sync()
    return start.elapsed_time(end) / iters


def run_mode(model, tok, mode: str, batch: int, args) -> dict:
    config = EngineConfig(max_num_seqs=batch, max_model_len=args.max_model_len,
                          prefill_chunk=args.prefill_chunk, cuda_graphs=mode != "eager",
                          compile_decode=mode == "compile")
    engine = Engine(model, tok, config, device=DEVICE, dtype=torch.bfloat16)
    if mode != "eager" and engine.graphs is None:  # CPU dry run: the runner without capture
        width = -(-args.max_model_len // config.block_size)
        engine.graphs = DecodeGraphs(engine.model, engine.cache, batch, width, capture=False)
    if mode == "compile" and engine.graphs.decode_fn == engine.model.forward_paged:
        engine.graphs.decode_fn = compiled_decode_fn(engine.model)  # CPU dry run
    # early rows decode while later ones prefill: no request may finish inside the timed steps
    params = SamplingParams(temperature=0, max_new_tokens=args.max_model_len, ignore_eos=True)
    if args.prompt_len + args.steps + 4 + batch >= args.max_model_len:
        raise SystemExit("--max-model-len too small for the prompt and the timed steps")
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(7, model.cfg.vocab_size, (args.prompt_len,), generator=g)
        engine.add_request(str(i), prompt.tolist(), params)
    t0 = time.perf_counter()
    while any(s.prefilling or s.completion_len == 0 for s in engine.sequences.values()) or (
        engine.scheduler.waiting
    ):
        engine.step()
    for _ in range(3):  # warm-up decode steps (graph capture happens here)
        engine.step()
    sync()
    warm_s = time.perf_counter() - t0
    start = time.perf_counter()
    for _ in range(args.steps):
        outs = engine.step()
        assert len(outs) == batch
    sync()
    step_ms = (time.perf_counter() - start) * 1000 / args.steps
    forward_ms = forward_only(engine, batch)
    return {
        "mode": mode, "batch": batch, "step_ms": round(step_ms, 3),
        "tokens_per_s": round(batch * 1000 / step_ms, 1), "forward_ms": round(forward_ms, 3),
        "prefill_and_warmup_s": round(warm_s, 2),
        "context_tokens": args.prompt_len + args.steps + 3,
    }


def forward_only(engine: Engine, batch: int) -> float:
    """The decode forward alone for the running rows (state advances: timing only)."""
    seqs = list(engine.scheduler.running)
    if engine.graphs is not None:
        graph, _ = next(iter(v for k, v in engine.graphs.graphs.items() if k[0] >= batch))
        return cuda_ms(graph.replay, 20)
    bs = engine.cache.block_size
    pos = torch.tensor([s.num_computed for s in seqs], device=DEVICE)
    tables = [engine.cache.tables[s.request_id] for s in seqs]
    width = max(map(len, tables))
    table = torch.tensor([t + [engine.cache.null_block] * (width - len(t)) for t in tables],
                         device=DEVICE)
    pb = PagedBatch(pos[:, None], table[torch.arange(len(seqs)), pos // bs] * bs + pos % bs,
                    table, torch.tensor([engine.cache.slot_of[s.request_id] for s in seqs],
                                        device=DEVICE))
    ids = torch.tensor([[s.token_ids[-1]] for s in seqs], device=DEVICE)
    return cuda_ms(lambda: engine.model.forward_paged(ids, engine.cache.layers, pb), 10)


def profile_eager(model, tok, batch: int, args) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    config = EngineConfig(max_num_seqs=batch, max_model_len=args.max_model_len, cuda_graphs=False)
    engine = Engine(model, tok, config, device=DEVICE, dtype=torch.bfloat16)
    params = SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), list(range(7, 7 + args.prompt_len)), params)
    for _ in range(4):
        engine.step()
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.step()
        sync()
    rows = []
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:25]:
        rows.append({"name": e.key[:80], "calls": e.count,
                     "cuda_ms": round(e.device_time_total / 1000, 3)})
    total = sum(e.device_time_total for e in device_rows(prof.key_averages()))
    rows.append({"name": "TOTAL cuda (self, all kernels)", "cuda_ms": round(total / 1000, 3)})
    return rows


def hf_llama_decode(batch: int, args) -> dict:
    """Context only: ``transformers`` generate with a ~350M Llama (bf16, greedy, random
    init), decode tokens/s from the time of N + 1 new tokens minus the time of 1."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32768, hidden_size=args.hf_hidden,
                      intermediate_size=args.hf_hidden * 11 // 4,
                      num_hidden_layers=args.hf_layers, num_attention_heads=args.hf_hidden // 64,
                      num_key_value_heads=args.hf_hidden // 64,
                      max_position_embeddings=2048, tie_word_embeddings=True)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(7, 32768, (batch, args.prompt_len), device=DEVICE)

    def generate(n: int) -> float:
        sync()
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                       min_new_tokens=n, do_sample=False, pad_token_id=0)
        sync()
        return time.perf_counter() - start

    generate(2)
    one, full = generate(1), generate(args.steps + 1)
    step_ms = (full - one) * 1000 / args.steps
    params = sum(p.numel() for p in model.parameters())
    return {"mode": "hf_llama_generate", "batch": batch, "step_ms": round(step_ms, 3),
            "tokens_per_s": round(batch * 1000 / step_ms, 1), "params": params}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="nam56r-350m")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--modes", nargs="+", default=["eager", "graphs"])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--hf-baseline", action="store_true")
    ap.add_argument("--hf-hidden", type=int, default=1024)
    ap.add_argument("--hf-layers", type=int, default=24)
    ap.add_argument("--out", type=Path, default=None,
                    help="results folder (default: benchmarks/results/engine_decode/<device>)")
    args = ap.parse_args()
    from megacpp.receipts.results import begin, results_dir

    out_dir = begin(args.out or results_dir("engine_decode"), "engine_decode", "engine_decode")
    out = out_dir / "engine_decode.json"
    torch.manual_seed(0)
    cfg = dataclasses.replace(load_config(args.config))
    with torch.device(DEVICE):
        model = HybridLM(cfg).to(torch.bfloat16).eval()
    tok = tokenizer()
    result = {
        "config": args.config, "params": sum(p.numel() for p in model.parameters()),
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(), "args": {k: str(v) for k, v in vars(args).items()},
        "rows": [],
    }
    for mode in args.modes:
        for batch in args.batch:
            row = run_mode(model, tok, mode, batch, args)
            print(json.dumps(row), flush=True)
            result["rows"].append(row)
            out.write_text(json.dumps(result, indent=1))
    if args.hf_baseline:
        for batch in args.batch:
            row = hf_llama_decode(batch, args)
            print(json.dumps(row), flush=True)
            result["rows"].append(row)
            out.write_text(json.dumps(result, indent=1))
    if args.profile:
        result["profile_eager"] = profile_eager(model, tok, max(args.batch), args)
        for r in result["profile_eager"]:
            print(r)
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
