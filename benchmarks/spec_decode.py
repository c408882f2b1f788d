"""Self-speculative decoding (MTP drafts): decode tokens/s with and without it, and the
acceptance rate, on a checkpoint with a trained MTP head.

    PYTHONPATH=src python benchmarks/spec_decode.py --checkpoint RUN_DIR --data DATA_DIR \\
        --batch 1 --k 1 2 3 --prompt-len 128 --new-tokens 256 --prompts 8 --max-seconds 30

Per batch size ``B``, ``--prompts`` prompts (the first ``--prompt-len`` tokens of rows of the
dataset's validation split: held-out C++) run in waves of ``B`` through the serving
``Engine``, greedy, ``--new-tokens`` tokens each (``ignore_eos``), once per system:

- ``plain``: one token per step (CUDA graphs on a GPU: the engine's default fast path);
- ``plain-eager``: the same without CUDA graphs (GPU only);
- ``spec-k<k>``: ``speculative_tokens = k`` (``megacpp serve --speculative-tokens k``); on a
  GPU its speculative step replays CUDA graphs (``infer/spec_graphs.py``) like ``plain``;
- ``spec-k<k>-eager`` (GPU, with ``--eager-spec``): the same without CUDA graphs.

Each system gets a warm-up run first (one wave of other validation prompts of the same shape:
graph capture, allocator; the timed prompts stay cold for the prefix cache), then the timed run.
Both are bounded by ``--max-seconds`` each (default 30): a system that is still decoding then
has its requests aborted and its row covers the tokens it made (``complete`` false), so a slow
system gives a partial row instead of losing the run. The defaults (8 prompts x 128 + 256
tokens at batch 1, k = 1, 2, 3, 30 s) are sized for about 3 minutes on an H100: every system
is bounded to twice ``--max-seconds`` (``plain-eager``, about 12 tok/s there, uses all of it)
and graphed ``plain`` (about 165 tok/s) needs some 13 s for the 8 x 256 tokens. Metrics per (system, B): ``decode_tok_s`` = tokens after each wave's last first
token / the time after it, summed over waves (``decode_tokens`` of them); ``output_tok_s``
(prefill included); ``acceptance`` = accepted / drafted
MTP tokens; ``tokens_per_step`` = tokens a greedy row gains per speculative step
(1 + accepted / verified rows); ``same_tokens`` = the fraction of tokens equal to ``plain``'s
(1.0 in float32/float64; bf16 verify-vs-decode rounding can flip near-ties; a partial row
compares the tokens both made); ``speedup`` = decode_tok_s / plain's. Writes ``spec_decode.json``, one ``bench`` receipt per (system, B)
under ``receipts/spec_decode/`` and ``command.txt`` to ``--out`` (default
``benchmarks/results/spec_decode/<device>``).

A trained MTP head is needed (the 1.5x goal needs one; a random head is almost never
accepted). The headline comparison is ``spec-k*`` against ``plain``, both graphed.

On one GPU (an H100: a few minutes of training, then the benchmark)::

    megacpp data build /usr/include/c++/12 --out data/libstdcxx-32k --config cpp
    megacpp train --config nam56r-small-gpu --set run.out_dir=runs/mtp-small \\
        --set model.mtp.depth=1 --set train.steps=1500 --set schedule.warmup_steps=100 \\
        --set checkpoint.every=500 --set train.eval_every=500
    PYTHONPATH=src python benchmarks/spec_decode.py --checkpoint runs/mtp-small \\
        --data data/libstdcxx-32k --batch 1 --k 1 2 3 --prompt-len 128 --new-tokens 256

On a CPU (the tiny preset, 200 steps; minutes on a free core)::

    megacpp data build /usr/include/c++/12 --out data/tiny-cpp --config tiny
    megacpp train --config tiny-cpu --set data.dir=data/tiny-cpp --set run.out_dir=runs/tiny-mtp \\
        --set model.mtp.depth=1 --set train.steps=200 --set schedule.warmup_steps=20
    PYTHONPATH=src python benchmarks/spec_decode.py --checkpoint runs/tiny-mtp \\
        --data data/tiny-cpp --device cpu --dtype float32 --threads 1 --batch 1 --k 1 2 3 \\
        --prompt-len 64 --new-tokens 64 --prompts 4
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

from serve_decode import run_wave

from megacpp.infer.engine import Engine, EngineConfig
from megacpp.kernels.runtime import chosen_kernels, set_kernel_mode


@dataclass
class Row:
    system: str  # "plain" | "plain-eager" | "spec-k<k>" | "spec-k<k>-eager"
    speculative_tokens: int
    batch: int
    prompts: int
    prompt_len: int
    new_tokens: int
    decode_tok_s: float
    output_tok_s: float
    acceptance: float | None  # accepted / drafted MTP tokens (None: no speculation)
    tokens_per_step: float | None  # tokens a greedy row gains per speculative step
    same_tokens: float  # fraction of tokens equal to plain's
    speedup: float | None  # decode_tok_s / plain's
    wall_s: float
    decode_tokens: int = 0  # the tokens decode_tok_s counts
    complete: bool = True  # False: --max-seconds ran out (the row covers the tokens made)


def validation_prompts(data: Path, n: int, prompt_len: int) -> list[list[int]]:
    """The first ``prompt_len`` tokens of the first ``n`` validation rows of a dataset."""
    import pyarrow.parquet as pq

    shards = sorted((data / "validation").glob("*.parquet"))
    if not shards:
        sys.exit(f"benchmarks/spec_decode.py: no validation shards under {data}/validation")
    rows: list[list[int]] = []
    for shard in shards:
        for tokens in pq.read_table(shard, columns=["tokens"]).column("tokens").to_pylist():
            if len(tokens) < prompt_len:
                sys.exit(f"--prompt-len {prompt_len}: the dataset's rows have {len(tokens)}")
            rows.append(list(tokens[:prompt_len]))
            if len(rows) == n:
                return rows
    sys.exit(f"benchmarks/spec_decode.py: {n} prompts wanted (--prompts, and a warm-up wave of "
             f"the largest --batch); the validation split has only {len(rows)} rows")


def run_system(engine: Engine, prompts: list[list[int]], batch: int, new_tokens: int,
               max_seconds: float):
    """Prompts in waves of ``batch`` for at most ``max_seconds``: (tokens per prompt that
    ran, decode tok/s, decode tokens, output tok/s, s, every wave finished)."""
    all_tokens: list[list[int]] = []
    decode_tokens = decode_time = output_tokens = output_time = 0.0
    deadline = time.perf_counter() + max_seconds
    finished = True
    for w in range(0, len(prompts), batch):
        tokens, times, t0, finished = run_wave(engine, prompts[w : w + batch], new_tokens,
                                               f"w{w}", deadline)
        all_tokens += tokens
        output_tokens += sum(len(ts) for ts in times)
        if all(times):  # every request of the wave has its first token
            last_first = max(ts[0] for ts in times)
            t_end = max(ts[-1] for ts in times)
            decode_tokens += sum(1 for ts in times for t in ts if t > last_first)
            decode_time += t_end - last_first
            output_time += t_end - t0
        if not finished:
            break
    return (all_tokens, decode_tokens / decode_time if decode_time else 0.0, int(decode_tokens),
            output_tokens / output_time if output_time else 0.0, output_time, finished)


def same_fraction(a: list[list[int]], b: list[list[int]]) -> float:
    """Equal tokens over the tokens both runs made (a partial run compares its prefix)."""
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / max(len(pairs), 1)


def bench(args, model, tok, device, dtype, prompts, warm_prompts) -> list[Row]:
    rows: list[Row] = []
    systems = [("plain", 0, True)]
    if device.type == "cuda":
        systems.append(("plain-eager", 0, False))
    systems += [(f"spec-k{k}", k, True) for k in args.k]
    if device.type == "cuda" and args.eager_spec:
        systems += [(f"spec-k{k}-eager", k, False) for k in args.k]
    for batch in args.batch:
        reference = plain_tok_s = None
        for name, k, graphs in systems:
            config = EngineConfig(max_num_seqs=batch, block_size=args.block_size,
                                  max_model_len=args.prompt_len + args.new_tokens + 1,
                                  cuda_graphs=graphs, speculative_tokens=k)
            engine = Engine(model, tok, config, device=device, dtype=dtype)
            run_system(engine, warm_prompts[:batch], batch, args.new_tokens,  # warm-up
                       args.max_seconds)
            before = engine.stats()
            tokens, decode_tok_s, decode_tokens, output_tok_s, wall, complete = run_system(
                engine, prompts, batch, args.new_tokens, args.max_seconds)
            stats = engine.stats()
            drafted = stats.spec_draft_tokens - before.spec_draft_tokens
            accepted = stats.spec_accepted_tokens - before.spec_accepted_tokens
            if reference is None:
                reference, plain_tok_s = tokens, decode_tok_s
            row = Row(
                system=name, speculative_tokens=k, batch=batch, prompts=len(prompts),
                prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                decode_tok_s=decode_tok_s, output_tok_s=output_tok_s,
                acceptance=accepted / drafted if drafted else None,
                tokens_per_step=1 + accepted / (drafted / k) if drafted else None,
                same_tokens=same_fraction(tokens, reference),
                speedup=decode_tok_s / plain_tok_s if name != "plain" and plain_tok_s else None,
                wall_s=wall, decode_tokens=decode_tokens, complete=complete)
            rows.append(row)
            print_row(row)
            del engine
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def print_row(r: Row) -> None:
    acc = "-" if r.acceptance is None else f"{r.acceptance:.3f}"
    tps = "-" if r.tokens_per_step is None else f"{r.tokens_per_step:.2f}"
    speed = "-" if r.speedup is None else f"x{r.speedup:.2f}"
    print(f"{r.system:12s} B={r.batch:<3d} decode {r.decode_tok_s:9.1f} tok/s  "
          f"output {r.output_tok_s:9.1f} tok/s  acceptance {acc:>5s}  tokens/step {tps:>4s}  "
          f"same {r.same_tokens:.3f}  speedup {speed}"
          f"{'' if r.complete else f'  PARTIAL ({r.decode_tokens} decode tokens)'}", flush=True)


def save(out: Path, rows: list[Row], args, meta: dict, preflight, facts) -> None:
    from megacpp.receipts import write_receipt

    payload = {"benchmark": "spec_decode", "command": " ".join(sys.argv), **meta,
               "settings": {k: str(v) if isinstance(v, Path) else v
                            for k, v in vars(args).items() if k != "out"},
               "chosen_kernels": chosen_kernels(), "results": [asdict(r) for r in rows]}
    (out / "spec_decode.json").write_text(json.dumps(payload, indent=2) + "\n")
    receipts = out / "receipts" / "spec_decode"
    for r in rows:
        config = {"benchmark": "spec_decode", "system": r.system,
                  "speculative_tokens": r.speculative_tokens, "batch": r.batch,
                  "prompts": r.prompts, "prompt_len": r.prompt_len, "new_tokens": r.new_tokens,
                  "block_size": args.block_size, "complete": r.complete, **meta,
                  "chosen_kernels": chosen_kernels()}
        metrics = {k: float(v) for k, v in asdict(r).items()
                   if isinstance(v, float | int) and not isinstance(v, bool)
                   and k not in ("batch", "prompts", "prompt_len", "new_tokens",
                                 "speculative_tokens")}
        write_receipt(receipts / f"{r.system}_B{r.batch}.json", "bench", config, metrics,
                      preflight=preflight, fingerprint=facts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, required=True,
                    help="a run directory or checkpoints/step_N of a model with [model.mtp]")
    ap.add_argument("--data", type=Path, required=True,
                    help="a `megacpp data build` directory: prompts from its validation split")
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3],
                    help="speculative tokens per step to measure")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-seconds", type=float, default=30.0,
                    help="per system: the warm-up and the timed run each stop after this "
                         "many seconds (the row is then partial: complete = false)")
    ap.add_argument("--eager-spec", action="store_true",
                    help="GPU: also spec-k<k>-eager rows (the speculative step without graphs)")
    ap.add_argument("--kernels", default="auto", choices=["reference", "auto", "fast"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--out", type=Path, default=None,
                    help="results folder (default: benchmarks/results/spec_decode/<device>)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's); 1 keeps a shared CPU's "
                         "timings from thread contention")
    ap.add_argument("--skip-preflight", action="append", default=[], metavar="RULE")
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/spec_decode.py: --device cuda but no CUDA GPU here")
    if min(args.batch) < 1 or min(args.k) < 1 or args.prompts < max(args.batch):
        sys.exit("--batch and --k must be >= 1, --prompts >= the largest --batch")
    if not args.max_seconds > 0:
        sys.exit(f"--max-seconds must be > 0, got {args.max_seconds}")
    set_kernel_mode(args.kernels)
    from megacpp.cli._checkpoint import load_for_inference
    from megacpp.contract import capture_fingerprint, load_contract_config, require_preflight
    from megacpp.receipts.results import begin, device_slug, results_dir

    model, tok, source = load_for_inference(args.checkpoint, None, str(device))
    if model.mtp is None:
        sys.exit(f"benchmarks/spec_decode.py: {source} has no MTP head ([model.mtp] depth = 0)")
    dtype = getattr(torch, args.dtype)
    read = validation_prompts(args.data, args.prompts + max(args.batch), args.prompt_len)
    prompts, warm_prompts = read[: args.prompts], read[args.prompts :]
    facts = capture_fingerprint()
    preflight = require_preflight(facts, load_contract_config(None), skip=args.skip_preflight)
    out = args.out or results_dir(
        "spec_decode", device_slug() if device.type == "cuda" else device.type)
    begin(out, "spec_decode", "spec_decode")
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "dtype": args.dtype, "checkpoint": str(source),
            "model_pattern": model.cfg.pattern, "mtp_depth": model.cfg.mtp.depth,
            "mtp_pattern": model.cfg.mtp.pattern,
            "params": sum(p.numel() for p in model.parameters()),
            "tokenizer_sha256": tok.sha256, "prompts_from": f"{args.data}/validation"}
    print(f"{meta['device']}  {args.dtype}  {source}  prompts {args.prompts} x "
          f"{args.prompt_len} tokens, {args.new_tokens} new", flush=True)
    rows = bench(args, model, tok, device, dtype, prompts, warm_prompts)
    save(out, rows, args, meta, preflight, facts)
    print(f"results: {out / 'spec_decode.json'}")


if __name__ == "__main__":
    main()
