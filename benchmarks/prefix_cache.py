"""Time to first token with prefix caching on vs off, on a shared-prefix workload.

Run on a GPU (the command docs/serving.md gives; no GPU result is recorded yet)::

    PYTHONPATH=src python benchmarks/prefix_cache.py --preset nam56r-350m \\
        --tokenizer TOKENIZER.json --requests 32 --prefix-len 2048 --suffix-len 32

and on a CPU as a smoke run (small model, short prefix)::

    PYTHONPATH=src python benchmarks/prefix_cache.py --device cpu --dtype float32 \\
        --preset tiny --requests 8 --prefix-len 256 --suffix-len 16 --new-tokens 4

The workload is what a code editor sends: ``--requests`` prompts that share one file prefix
of ``--prefix-len`` token ids (BOS first, random ids: the weights are a random init, so the
work per token does not depend on them) and end in distinct suffixes of ``--suffix-len``
random ids; each generates ``--new-tokens`` tokens (greedy, ``ignore_eos``). Two arrivals:

- **burst**: every request arrives at t0 (the engine batches them; a request's TTFT includes
  its wait for the requests ahead of it);
- **sequential**: each request arrives when the one before it has finished (TTFT is one
  request's prefill alone).

For each arrival, the engine runs with ``prefix_cache`` off and on (a fresh engine each,
same settings otherwise). A warm-up pass of the same workload over a *different* prefix comes
first (it captures the CUDA graphs and compiles the kernels of the same shapes; it leaves no
blocks the timed prefix can hit). Times are host clocks after the engine's per-step sync.

Metrics per (arrival, cache): TTFT p50 / p90 (ms), wall time of the run, prompt tokens looked
up and reused (the hit rate), prompt tokens computed, and whether each request's greedy tokens
equal those of the cache-off run (bf16 on a GPU may differ where chunking changes a
summation order; a CPU float32 run is expected to match). Writes, to ``--out`` (default
``benchmarks/results/prefix_cache/<device>``), ``prefix_cache.json``, one ``bench`` receipt
per (arrival, cache) under ``receipts/prefix_cache/`` and ``command.txt``. The goal: TTFT p50
at least 3x lower with the cache on, on one H100 with nam56r-350m.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from engine_decode import tokenizer as small_tokenizer  # 600 tokens over src/ (decoding only)
from serve_decode import percentile, sync

from megacpp.data.tokenizer import CppTokenizer
from megacpp.infer.engine import Engine, EngineConfig
from megacpp.infer.sampling import SamplingParams
from megacpp.kernels.runtime import chosen_kernels, set_kernel_mode
from megacpp.model.config import load_config
from megacpp.model.model import HybridLM


@dataclass
class Row:
    arrival: str  # "burst" | "sequential"
    cache: str  # "on" | "off"
    requests: int
    prefix_len: int
    suffix_len: int
    new_tokens: int
    ttft_ms_p50: float
    ttft_ms_p90: float
    wall_s: float
    prompt_tokens: int
    hit_tokens: int
    hit_rate: float
    computed_prompt_tokens: int
    same_tokens_as_off: float  # fraction of requests whose tokens equal the cache-off run's


def workload(args, vocab: int, bos: int, seed: int) -> list[list[int]]:
    """``--requests`` prompts: one shared prefix, distinct suffixes (ids >= 16: no specials)."""
    g = torch.Generator().manual_seed(seed)
    prefix = [bos, *torch.randint(16, vocab, (args.prefix_len - 1,), generator=g).tolist()]
    suffixes = torch.randint(16, vocab, (args.requests, args.suffix_len), generator=g).tolist()
    return [prefix + s for s in suffixes]


def run(engine: Engine, prompts: list[list[int]], new_tokens: int, arrival: str, tag: str):
    """Each request's TTFT (s), its tokens, and the run's wall time."""
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    ttft: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    sync(engine.device)
    t0 = time.perf_counter()

    def add(i: int) -> tuple[str, float]:
        rid = f"{tag}-{i}"
        tokens[rid] = []
        engine.add_request(rid, prompts[i], params)
        return rid, time.perf_counter()

    def drain(arrived: dict[str, float]) -> None:
        while engine.has_unfinished():
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                if out.new_token_ids and out.request_id not in ttft:
                    ttft[out.request_id] = now - arrived[out.request_id]
                tokens[out.request_id] += out.new_token_ids

    if arrival == "burst":  # every request arrived at t0
        for i in range(len(prompts)):
            add(i)
        drain(dict.fromkeys(tokens, t0))
    else:
        for i in range(len(prompts)):
            drain(dict([add(i)]))
    wall = time.perf_counter() - t0
    return [ttft[r] for r in tokens], list(tokens.values()), wall


def build_engine(model, tok, args, device, dtype, cache: bool) -> Engine:
    max_len = args.prefix_len + args.suffix_len + args.new_tokens
    config = EngineConfig(
        max_num_seqs=args.requests, block_size=args.block_size,
        max_model_len=-(-(max_len + 1) // args.block_size) * args.block_size,
        prefill_chunk=args.prefill_chunk, prefix_cache=cache,
        snapshot_interval=args.snapshot_interval, cuda_graphs=device.type == "cuda")
    return Engine(model, tok, config, device=device, dtype=dtype)


def measure(model, tok, args, device, dtype, arrival: str, cache: bool,
            reference: list[list[int]] | None) -> tuple[Row, list[list[int]]]:
    engine = build_engine(model, tok, args, device, dtype, cache)
    vocab, bos = model.cfg.vocab_size, tok.bos_id
    run(engine, workload(args, vocab, bos, seed=1), args.new_tokens, arrival, "warm")
    before = engine.stats()
    ttft, tokens, wall = run(engine, workload(args, vocab, bos, seed=0), args.new_tokens,
                             arrival, "timed")
    stats = engine.stats()
    queried = stats.prefix_queried_tokens - before.prefix_queried_tokens
    hits = stats.prefix_hit_tokens - before.prefix_hit_tokens
    prompt_tokens = args.requests * (args.prefix_len + args.suffix_len)
    same = 1.0 if reference is None else \
        sum(a == b for a, b in zip(tokens, reference, strict=True)) / len(tokens)
    row = Row(arrival=arrival, cache="on" if cache else "off", requests=args.requests,
              prefix_len=args.prefix_len, suffix_len=args.suffix_len,
              new_tokens=args.new_tokens,
              ttft_ms_p50=percentile(ttft, 50) * 1e3, ttft_ms_p90=percentile(ttft, 90) * 1e3,
              wall_s=wall, prompt_tokens=prompt_tokens, hit_tokens=hits,
              hit_rate=hits / queried if queried else 0.0,
              computed_prompt_tokens=prompt_tokens - hits, same_tokens_as_off=same)
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row, tokens


def save(out: Path, rows: list[Row], args, preflight, facts, speedups: dict) -> None:
    from megacpp.receipts import write_receipt

    payload = {
        "benchmark": "prefix_cache",
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "settings": {k: str(v) for k, v in vars(args).items() if k != "out"},
        "chosen_kernels": chosen_kernels(),
        "ttft_p50_off_over_on": speedups,
        "results": [asdict(r) for r in rows],
    }
    (out / "prefix_cache.json").write_text(json.dumps(payload, indent=2) + "\n")
    receipts = out / "receipts" / "prefix_cache"
    for r in rows:
        config = {"benchmark": "prefix_cache", "arrival": r.arrival, "cache": r.cache,
                  "model": args.preset, "requests": r.requests, "prefix_len": r.prefix_len,
                  "suffix_len": r.suffix_len, "new_tokens": r.new_tokens, "dtype": args.dtype,
                  "block_size": args.block_size, "prefill_chunk": args.prefill_chunk,
                  "snapshot_interval": args.snapshot_interval, "weights": "random init",
                  "kernels": args.kernels, "chosen_kernels": chosen_kernels()}
        metrics = {k: float(v) for k, v in asdict(r).items()
                   if isinstance(v, float | int) and k not in ("requests", "prefix_len",
                                                               "suffix_len", "new_tokens")}
        write_receipt(receipts / f"{r.arrival}_{r.cache}.json", "bench", config, metrics,
                      preflight=preflight, fingerprint=facts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="nam56r-350m")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="a megacpp tokenizer.json (default: a small one trained here)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--arrivals", nargs="+", default=["burst", "sequential"],
                    choices=["burst", "sequential"])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prefill-chunk", type=int, default=EngineConfig.prefill_chunk)
    ap.add_argument("--snapshot-interval", type=int, default=EngineConfig.snapshot_interval)
    ap.add_argument("--kernels", default="auto", choices=["reference", "auto", "fast"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--out", type=Path, default=None,
                    help="results folder (default: benchmarks/results/prefix_cache/<device>)")
    ap.add_argument("--skip-preflight", action="append", default=[], metavar="RULE")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/prefix_cache.py: --device cuda but no CUDA GPU here")
    if args.requests < 1 or args.prefix_len < 2 or args.suffix_len < 1 or args.new_tokens < 1:
        sys.exit("--requests, --suffix-len and --new-tokens must be >= 1, --prefix-len >= 2")
    set_kernel_mode(args.kernels)
    dtype = getattr(torch, args.dtype)
    tok = CppTokenizer.load(args.tokenizer) if args.tokenizer else small_tokenizer()
    from megacpp.contract import capture_fingerprint, load_contract_config, require_preflight
    from megacpp.receipts.results import begin, device_slug, results_dir

    facts = capture_fingerprint()
    preflight = require_preflight(facts, load_contract_config(None), skip=args.skip_preflight)
    out = args.out or results_dir(
        "prefix_cache", device_slug() if device.type == "cuda" else device.type)
    begin(out, "prefix_cache", "prefix_cache")
    torch.manual_seed(0)
    model = HybridLM(load_config(args.preset)).to(device=device, dtype=dtype).eval()
    if tok.vocab_size > model.cfg.vocab_size:
        sys.exit(f"the tokenizer has {tok.vocab_size} tokens, {args.preset} only "
                 f"{model.cfg.vocab_size}")
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}  "
          f"{args.preset} {args.dtype}  {args.requests} requests  prefix {args.prefix_len}  "
          f"suffix {args.suffix_len}  new tokens {args.new_tokens}", flush=True)
    rows: list[Row] = []
    speedups: dict[str, float] = {}
    for arrival in args.arrivals:
        off, off_tokens = measure(model, tok, args, device, dtype, arrival, False, None)
        on, _ = measure(model, tok, args, device, dtype, arrival, True, off_tokens)
        rows += [off, on]
        speedups[arrival] = off.ttft_ms_p50 / on.ttft_ms_p50
        for r in (off, on):
            print(f"{r.arrival:>10} cache {r.cache:>3}: TTFT p50 {r.ttft_ms_p50:9.1f} ms  "
                  f"p90 {r.ttft_ms_p90:9.1f} ms  wall {r.wall_s:7.2f} s  hit rate "
                  f"{r.hit_rate:5.1%}  computed {r.computed_prompt_tokens} prompt tokens  "
                  f"same tokens {r.same_tokens_as_off:.0%}", flush=True)
        print(f"{arrival:>10}: TTFT p50 {speedups[arrival]:.2f}x lower with the cache on",
              flush=True)
        save(out, rows, args, preflight, facts, speedups)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
