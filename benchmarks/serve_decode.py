"""Decode throughput and latency: our serving Engine vs. ``transformers`` ``generate``.

Run on a GPU (the README quotes its H100 numbers)::

    PYTHONPATH=src python benchmarks/serve_decode.py --preset nam56r-350m \\
        --tokenizer TOKENIZER.json --batch 1 16 64 --prompt-len 128 --new-tokens 256

Both systems run in this one process on one device, in bf16 weights (no autocast):

- **engine**: ``megacpp.infer.engine.Engine`` over the hybrid preset (random init: the
  weights do not change the work per token) with paged KV caches, continuous batching and
  incremental detokenization, driven step by step as the server's engine thread drives it.
- **hf**: ``transformers`` ``LlamaForCausalLM.generate`` (SDPA attention, dynamic KV cache,
  no compile) with a dense Llama sized to the hybrid's *total* parameter count (the peer of
  ``benchmarks/train_step.py``), random init.
- **hf-static**: the same Llama through transformers' documented fast path: a static KV
  cache (``StaticCache``, one per batch size, reused across calls after ``reset()``, so its
  tensors keep their addresses) with which ``generate`` compiles its decode forward itself
  (``CompileConfig``: inductor, ``reduce-overhead`` = CUDA graphs, one static graph per batch
  size; ``--hf-compile-backend``, ``--hf-compile-mode``). Its prefill runs eagerly, as
  ``generate`` does.

Per batch size ``B``: ``B`` prompts of ``--prompt-len`` random token ids (BOS first; the
same ids for both systems) all arrive at t0; each generates exactly ``--new-tokens`` tokens
(greedy; ``ignore_eos`` for the engine, ``min_new_tokens`` for hf), so both do the same
number of decode steps. A warm-up run per batch size comes first: for ``engine``,
``engine-compiled`` and ``hf-static`` a run of the same shape (the engine captures the CUDA
graphs of exactly the prefill and decode buckets the timed run replays; transformers compiles
and records its decode forward for exactly the shapes and cache the timed run uses, so no
compile or recording is timed), for the others 8 tokens. The warm-up's prompts are other
random tokens, so the engine's prefix cache holds none of the timed prompts' blocks.
``engine-compiled`` is ``engine`` with ``compile_decode=True`` (inductor fuses each block
family's decode step inside the captured graphs). ``engine-eager`` is the engine with
``cuda_graphs=False`` and ``prefill_graphs=False``, for reference;
``engine-async`` is the graphs engine driven through ``AsyncEngine`` (the server's engine
thread and asyncio consumers, no HTTP), measured right after ``engine`` on the same engine. Times are host
clocks after the per-step device sync both systems already do (the engine reads sampled
tokens with ``.tolist()``; hf's streamer gets ``tokens.cpu()``).

Metrics per (system, B): ``output_tok_s`` = B x new tokens / (last token - t0), prefill
included; ``decode_tok_s`` = tokens produced after the last request's first token / the time
after it (steady-state decode); TTFT (t0 -> a request's first token) and inter-token latency
(between a request's consecutive tokens) p50/p90/p99 in ms. Prints a table with the
engine/hf ratios and writes, to ``--out`` (default ``benchmarks/results/serve_decode/<device>``),
``serve_decode.json``, one ``bench`` receipt per (system, B) under ``receipts/serve_decode/``
and ``command.txt``.

``--profile`` measures nothing of the above: per batch size it profiles, with
``torch.profiler``, the engine step that prefills all prompts (as served and eagerly) and
``--profile-steps`` decode steps (after a warm-up), and writes ``profile_B<B>.json`` and
``.txt``: host launches (kernel and graph launches) and device
kernels per decode step, the kernels' device time by name, the device time per block
family from an eager pass (``record_function`` per block; a captured graph hides that
split), and the weight bytes a decode step reads (counted from the model: every weight
but the embedding rows not looked up; the MoE decode step runs every expert) per token,
against the weights' size and the step's time (the bandwidth that implies).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from megacpp.data.tokenizer import CppTokenizer
from megacpp.infer.engine import Engine, EngineConfig
from megacpp.infer.sampling import SamplingParams
from megacpp.kernels.runtime import chosen_kernels, set_kernel_mode
from megacpp.model.config import load_config
from megacpp.model.counting import count_model
from megacpp.model.model import HybridLM


@dataclass
class Row:
    system: str  # "engine" | "engine-async" | "engine-compiled" | "engine-eager" | "hf" | "hf-static"
    model: str
    batch: int
    prompt_len: int
    new_tokens: int
    params: int
    active_params: int
    output_tok_s: float
    decode_tok_s: float
    ttft_ms_p50: float
    ttft_ms_p90: float
    ttft_ms_p99: float
    itl_ms_p50: float
    itl_ms_p90: float
    itl_ms_p99: float
    wall_s: float
    peak_mem_gib: float
    error: str | None = None
    graphs_compiled_in_run: int = 0  # torch.compile graphs built during the timed run


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of non-empty ``values``."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(token_times: list[list[float]], t0: float) -> dict[str, float]:
    """Throughput and latency from each request's token timestamps (host seconds)."""
    n_tokens = sum(len(ts) for ts in token_times)
    t_end = max(ts[-1] for ts in token_times)
    last_first = max(ts[0] for ts in token_times)
    after = sum(1 for ts in token_times for t in ts if t > last_first)
    ttft = [(ts[0] - t0) * 1e3 for ts in token_times]
    itl = [(b - a) * 1e3 for ts in token_times for a, b in itertools.pairwise(ts)]
    out = {"output_tok_s": n_tokens / (t_end - t0),
           "decode_tok_s": after / (t_end - last_first) if t_end > last_first else float("nan"),
           "wall_s": t_end - t0}
    for q in (50, 90, 99):
        out[f"ttft_ms_p{q}"] = percentile(ttft, q)
        out[f"itl_ms_p{q}"] = percentile(itl, q) if itl else float("nan")
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_prompts(batch: int, prompt_len: int, vocab: int, bos: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    body = torch.randint(16, vocab, (batch, prompt_len - 1), generator=g)  # no special ids
    return [[bos, *row] for row in body.tolist()]


# ---- our engine -----------------------------------------------------------------------------


def run_wave(engine: Engine, prompts: list[list[int]], new_tokens: int, tag: str,
             deadline: float | None = None):
    """All ``prompts`` arriving at once, greedy, ``new_tokens`` each (``ignore_eos``), until
    done or past ``deadline`` (a ``time.perf_counter()`` value; then the rest is aborted)
    -> (tokens per request, [host time of each token per request], t0, finished)."""
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    sync(engine.device)
    t0 = time.perf_counter()
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    times: dict[str, list[float]] = {rid: [] for rid in ids}
    finished = True
    while engine.has_unfinished():
        if finished and deadline is not None and time.perf_counter() > deadline:
            finished = False
            for rid in ids:
                engine.abort(rid)  # reported by the next step, with no tokens
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            tokens[out.request_id] += out.new_token_ids
            times[out.request_id] += [now] * len(out.new_token_ids)
    return list(tokens.values()), list(times.values()), t0, finished


def run_engine(engine: Engine, prompts: list[list[int]], new_tokens: int, tag: str):
    _, times, t0, _ = run_wave(engine, prompts, new_tokens, tag)
    assert all(len(ts) == new_tokens for ts in times), "a request stopped early"
    return times, t0


def run_async(engine: Engine, prompts: list[list[int]], new_tokens: int, tag: str):
    """The same through :class:`AsyncEngine` (the server's path: an engine thread, one
    asyncio consumer per request); token times are taken when the consumer receives them."""
    import asyncio

    from megacpp.infer.async_engine import AsyncEngine

    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)

    async def main():
        wrapper = AsyncEngine(engine, "bench")
        wrapper.start()

        async def one(i: int, prompt: list[int]) -> list[float]:
            times: list[float] = []
            async for out in wrapper.generate(f"{tag}-{i}", prompt, params):
                times.extend([time.perf_counter()] * len(out.new_token_ids))
            return times

        try:
            sync(engine.device)
            t0 = time.perf_counter()
            times = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        finally:
            await wrapper.shutdown()
        return list(times), t0

    times, t0 = asyncio.run(main())
    assert all(len(ts) == new_tokens for ts in times), "a request stopped early"
    return times, t0


# ---- the transformers peer ------------------------------------------------------------------


class TimingStreamer:
    """A ``generate`` streamer that records when each step's tokens reach the host."""

    def __init__(self) -> None:
        self.prompt_seen = False
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        now = time.perf_counter()  # put() receives host tensors: the step has synced
        if not self.prompt_seen:
            self.prompt_seen = True  # the first call carries the prompt
            return
        self.times.append(now)

    def end(self) -> None:
        pass


def run_hf(model, prompts: list[list[int]], new_tokens: int, device: torch.device,
           **generate_kwargs):
    """Greedy ``generate`` of exactly ``new_tokens`` per prompt, timed by a streamer."""
    ids = torch.tensor(prompts, device=device)
    streamer = TimingStreamer()
    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, use_cache=True, streamer=streamer,
                             pad_token_id=0, **generate_kwargs)
    sync(device)
    assert out.shape[1] == ids.shape[1] + new_tokens, out.shape
    assert len(streamer.times) == new_tokens, len(streamer.times)
    return [list(streamer.times) for _ in prompts], t0  # a static batch: one clock per step


def hf_compile_config(args):
    """generate()'s compile settings for hf-static (on a CPU, compiled too: a smoke test)."""
    from transformers import CompileConfig

    mode = None if args.hf_compile_mode == "none" else args.hf_compile_mode
    # dynamic=False: one graph specialised per batch size (each is compiled in its warm-up),
    # instead of the default's switch to a dynamic batch dimension at the second size
    config = CompileConfig(backend=args.hf_compile_backend, mode=mode, dynamic=False)
    config._compile_all_devices = True  # transformers: compile off CUDA too (for testing)
    return config


def run_hf_static(model, caches: dict, prompts: list[list[int]], new_tokens: int,
                  device: torch.device, max_cache_len: int, compile_config):
    """``generate`` with a static cache of ``max_cache_len`` tokens for this batch size, made
    once and reset before each call (same tensors: no recompile, no re-recorded graphs)."""
    import inspect

    from transformers import StaticCache

    batch = len(prompts)
    if batch not in caches:
        caches[batch] = StaticCache(config=model.config, max_cache_len=max_cache_len)
    cache = caches[batch]
    cache.reset()
    # transformers 5 names generate's cache argument ``cache`` (``past_key_values`` before)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return run_hf(model, prompts, new_tokens, device, compile_config=compile_config,
                  **{name: cache})


def build_llama(target_params: int, vocab: int, d_model: int, max_len: int, device, dtype):
    from train_step import llama_peer

    model, _, params, _, _, name = llama_peer(target_params, vocab, d_model, max_len)
    model.generation_config.eos_token_id = None  # exactly new_tokens tokens, never EOS
    return model.to(device=device, dtype=dtype).eval(), params, name


# ---- driver ---------------------------------------------------------------------------------


GRAPHED = ("engine", "engine-compiled", "hf-static")  # warmed up with a whole run
WARM_SEED = 1_000_003  # warm-up prompts' seed offset (the timed prompts use seed = batch)


def measure(system: str, runner, batch: int, args, meta: dict) -> Row:
    device = meta["device"]
    prompts = random_prompts(batch, args.prompt_len, meta["vocab"], meta["bos"], seed=batch)
    # the engine's warm-up is the whole run: it captures exactly the graphs the run replays.
    # Its prompts have the same shape but other tokens, so the timed run's prompts are cold
    # (the engine's prefix cache would otherwise serve them from the warm-up's blocks).
    warm = args.new_tokens if system in GRAPHED else min(8, args.new_tokens)
    warm_prompts = random_prompts(batch, args.prompt_len, meta["vocab"], meta["bos"],
                                  seed=WARM_SEED + batch)
    runner(warm_prompts, warm, f"warm{batch}")
    gc.collect()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    compiled = compiled_graphs()
    token_times, t0 = runner(prompts, args.new_tokens, f"b{batch}")
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return Row(system=system, model=meta["name"], batch=batch, prompt_len=args.prompt_len,
               new_tokens=args.new_tokens, params=meta["params"],
               active_params=meta["active_params"], peak_mem_gib=peak,
               graphs_compiled_in_run=compiled_graphs() - compiled,
               **summarize(token_times, t0))


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far (0 before any compile)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def failed_row(system: str, batch: int, args, meta: dict, exc: BaseException) -> Row:
    nan = float("nan")
    return Row(system, meta["name"], batch, args.prompt_len, args.new_tokens, meta["params"],
               meta["active_params"], nan, nan, nan, nan, nan, nan, nan, nan, nan, nan,
               error=f"{type(exc).__name__}: {exc}"[:300])


def bench_engine(args, device, dtype, tok: CppTokenizer, system: str) -> list[Row]:
    cfg = load_config(args.preset)
    cost = count_model(cfg)
    torch.manual_seed(0)
    model = HybridLM(cfg)
    config = EngineConfig(max_num_seqs=max(args.batch), block_size=args.block_size,
                          max_model_len=args.prompt_len + args.new_tokens,
                          prefill_chunk=args.prefill_chunk, max_waiting=max(args.batch),
                          cuda_graphs=system != "engine-eager",
                          compile_decode=system == "engine-compiled",
                          prefill_graphs=system != "engine-eager" and args.prefill_graphs,
                          prefill_graph_tokens=args.prefill_graph_tokens)
    engine = Engine(model, tok, config, device=device, dtype=dtype)
    meta = {"device": device, "vocab": min(cfg.vocab_size, tok.vocab_size), "bos": tok.bos_id,
            "name": args.preset, "params": cost.params, "active_params": cost.active_params}

    def runner(prompts, new_tokens, tag):
        return run_engine(engine, prompts, new_tokens, tag)

    def async_runner(prompts, new_tokens, tag):
        return run_async(engine, prompts, new_tokens, tag)

    rows = []
    for batch in args.batch:
        runs = [(system, runner)]
        if system == "engine" and "engine-async" in args.systems:
            runs.append(("engine-async", async_runner))  # same engine, graphs already warm
        for name, run in runs:
            try:
                rows.append(measure(name, run, batch, args, meta))
            except torch.OutOfMemoryError as exc:
                rows.append(failed_row(name, batch, args, meta, exc))
            print_row(rows[-1])
    return rows


def bench_hf(args, device, dtype, tok: CppTokenizer, system: str = "hf") -> list[Row]:
    cfg = load_config(args.preset)
    cost = count_model(cfg)
    torch.manual_seed(0)
    max_len = args.prompt_len + args.new_tokens
    model, params, name = build_llama(cost.params, cfg.vocab_size, cfg.d_model, max_len,
                                      device, dtype)
    meta = {"device": device, "vocab": min(cfg.vocab_size, tok.vocab_size), "bos": tok.bos_id,
            "name": name, "params": params, "active_params": params}
    caches: dict = {}
    compile_config = None
    if system == "hf-static":
        compile_config = hf_compile_config(args)
        # one specialised graph per batch size: past dynamo's recompile limit it would run
        # the later sizes uncompiled
        from torch._dynamo import config as dynamo

        dynamo.recompile_limit = max(dynamo.recompile_limit, 4 * len(args.batch))

    def runner(prompts, new_tokens, tag):
        if system == "hf-static":
            return run_hf_static(model, caches, prompts, new_tokens, device, max_len,
                                 compile_config)
        return run_hf(model, prompts, new_tokens, device)

    rows = []
    for batch in args.batch:
        try:
            rows.append(measure(system, runner, batch, args, meta))
        except torch.OutOfMemoryError as exc:
            rows.append(failed_row(system, batch, args, meta, exc))
        print_row(rows[-1])
    return rows


def release(device: torch.device) -> None:
    """Free the last system's model and caches before the next one is built."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def print_row(r: Row) -> None:
    if r.error:
        print(f"{r.system:>12} B={r.batch:<3} {r.model}: {r.error}", flush=True)
        return
    print(f"{r.system:>12} B={r.batch:<3} {r.model:>15}  out {r.output_tok_s:9.0f} tok/s  "
          f"decode {r.decode_tok_s:9.0f} tok/s  TTFT p50 {r.ttft_ms_p50:8.1f} ms  "
          f"ITL p50/p99 {r.itl_ms_p50:6.2f}/{r.itl_ms_p99:6.2f} ms  mem {r.peak_mem_gib:5.1f} GiB"
          + (f"  COMPILED {r.graphs_compiled_in_run} graphs in the timed run"
             if r.graphs_compiled_in_run else ""), flush=True)


def ratios(rows: list[Row], peer_system: str = "hf") -> dict[int, dict[str, float]]:
    """Per batch size, the engine over ``peer_system``: throughputs (higher is better for
    the engine above 1) and latencies (engine / peer: below 1 is better for the engine)."""
    by = {(r.system, r.batch): r for r in rows if not r.error}
    out = {}
    for (system, batch), r in by.items():
        peer = by.get((peer_system, batch))
        if system == "engine" and peer is not None:
            out[batch] = {"decode_tok_s": r.decode_tok_s / peer.decode_tok_s,
                          "output_tok_s": r.output_tok_s / peer.output_tok_s,
                          "ttft_ms_p50": r.ttft_ms_p50 / peer.ttft_ms_p50,
                          "itl_ms_p50": r.itl_ms_p50 / peer.itl_ms_p50}
    return out


def save(out: Path, rows: list[Row], args, preflight, facts, tokenizer_sha256: str) -> None:
    from megacpp.receipts import write_receipt

    payload = {
        "benchmark": "serve_decode",
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "dtype": args.dtype,
        "tokenizer_sha256": tokenizer_sha256,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "tokenizer")},
        "chosen_kernels": chosen_kernels(),
        # the timed prompts are cold: the warm-up ran other prompts of the same shape (a
        # result without this key warmed up on the timed prompts themselves, so the engine's
        # prefix cache served their prefill and its TTFT does not measure a cold prompt)
        "warmup_prompts": f"other random tokens (seed {WARM_SEED} + batch)",
        "engine_over_hf": {str(b): v for b, v in ratios(rows).items()},
        "engine_over_hf_static": {str(b): v for b, v in ratios(rows, "hf-static").items()},
        "results": [asdict(r) for r in rows],
    }
    (out / "serve_decode.json").write_text(json.dumps(payload, indent=2) + "\n")
    receipts = out / "receipts" / "serve_decode"
    for r in rows:
        if r.error:
            continue
        config = {"benchmark": "serve_decode", "system": r.system, "model": r.model,
                  "batch": r.batch, "prompt_len": r.prompt_len, "new_tokens": r.new_tokens,
                  "dtype": args.dtype, "block_size": args.block_size,
                  "prefill_chunk": args.prefill_chunk, "prefill_graphs": args.prefill_graphs,
                  "prefill_graph_tokens": args.prefill_graph_tokens, "weights": "random init",
                  "kernels": args.kernels, "chosen_kernels": chosen_kernels(),
                  "tokenizer_sha256": tokenizer_sha256}
        metrics = {k: float(v) for k, v in asdict(r).items()
                   if isinstance(v, float | int) and k not in ("batch", "prompt_len",
                                                               "new_tokens")}
        write_receipt(receipts / f"{r.system}_B{r.batch}.json", "bench", config, metrics,
                      preflight=preflight, fingerprint=facts)


def _version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001 - not installed
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="nam56r-350m")
    ap.add_argument("--tokenizer", type=Path, required=True,
                    help="a megacpp tokenizer.json (vocab <= the model's); for detokenization")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prefill-chunk", type=int, default=EngineConfig.prefill_chunk)
    ap.add_argument("--kernels", default="auto", choices=["reference", "auto", "fast"],
                    help="kernel mode of the engine's model (megacpp serve's default: auto)")
    ap.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="the engine's captured prefill graphs (megacpp serve's default)")
    ap.add_argument("--prefill-graph-tokens", type=int,
                    default=EngineConfig.prefill_graph_tokens,
                    help="the largest captured prefill bucket, batch x length")
    ap.add_argument("--systems", nargs="+", default=["engine", "hf", "hf-static"],
                    choices=["engine", "engine-async", "engine-compiled", "engine-eager", "hf",
                             "hf-static"])
    ap.add_argument("--hf-compile-backend", default="inductor",
                    help="hf-static: torch.compile backend of generate's decode forward")
    ap.add_argument("--hf-compile-mode", default="reduce-overhead",
                    help="hf-static: torch.compile mode ('none' for a backend without modes)")
    ap.add_argument("--profile", action="store_true",
                    help="profile the engine's decode step instead (see the docstring)")
    ap.add_argument("--profile-steps", type=int, default=16)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--out", type=Path, default=None,
                    help="results folder (default: benchmarks/results/serve_decode/<device>)")
    ap.add_argument("--skip-preflight", action="append", default=[], metavar="RULE")
    args = ap.parse_args()
    set_kernel_mode(args.kernels)  # the engine rows only: hf runs its own kernels
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/serve_decode.py: --device cuda but no CUDA GPU here")
    if args.prompt_len < 2 or args.new_tokens < 2 or min(args.batch) < 1:
        sys.exit("--prompt-len and --new-tokens must be >= 2, --batch >= 1")
    if args.profile_steps < 1:
        sys.exit("--profile-steps must be >= 1")
    dtype = getattr(torch, args.dtype)
    tok = CppTokenizer.load(args.tokenizer)
    from megacpp.contract import capture_fingerprint, load_contract_config, require_preflight
    from megacpp.receipts.results import begin, device_slug, results_dir

    facts = capture_fingerprint()
    preflight = require_preflight(facts, load_contract_config(None), skip=args.skip_preflight)
    out = args.out or results_dir(
        "serve_decode", device_slug() if device.type == "cuda" else device.type)
    begin(out, "serve_decode", "serve_decode")
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}  "
          f"dtype {args.dtype}  prompt {args.prompt_len}  new tokens {args.new_tokens}",
          flush=True)
    if args.profile:
        from serve_profile import profile_engine

        for batch in args.batch:
            profile_engine(args, device, dtype, tok, batch, out)
        return
    rows: list[Row] = []
    for system in ("engine", "hf-static", "engine-compiled", "hf", "engine-eager"):  # least needed last
        if system not in args.systems:
            continue
        try:
            if system in ("hf", "hf-static"):
                rows += bench_hf(args, device, dtype, tok, system)
            else:
                rows += bench_engine(args, device, dtype, tok, system)
        except Exception:  # noqa: BLE001 - one system failing must not lose the others
            traceback.print_exc()
            print(f"{system}: FAILED (traceback above); continuing", flush=True)
        release(device)
        # saved (and receipted) after each system: a cut-off run keeps its rows
        save(out, rows, args, preflight, facts, tok.sha256)
    for peer in ("hf", "hf-static"):
        for batch, r in ratios(rows, peer).items():
            print(f"engine / {peer} at B={batch}: decode x{r['decode_tok_s']:.2f}, "
                  f"output x{r['output_tok_s']:.2f}, TTFT p50 x{r['ttft_ms_p50']:.2f}, "
                  f"ITL p50 x{r['itl_ms_p50']:.2f}")
    print(f"results: {out / 'serve_decode.json'}")


if __name__ == "__main__":
    main()
