"""Training-step throughput: the hybrid model (per kernel mode) vs. a dense Llama peer.

Run on a GPU (the README quotes its H100 numbers)::

    PYTHONPATH=src python benchmarks/train_step.py --preset nam56r-350m --seq-len 2048 4096 \
        --modes eager compiled

    # the fast path too (MEGACPP_KERNELS=auto: our Triton kernels where they qualify), with
    # a profile of each row: GPU time per kernel family, top CUDA kernels
    ... --kernels reference auto --profile /tmp/train_step_profiles

    # the whole step as one CUDA graph (no host launches: the GPU-bound step rate)
    ... --kernels fast --modes eager compiled graphed compiled-graphed

Everything is measured in one process on one device: first the bf16 matmul peak
(8192^3, random data), then, for each model x mode x sequence length, the median time of a
full training step (forward, backward, fused AdamW step) in bf16 autocast with fp32
parameters, after warm-up. The peer is ``transformers``' LlamaForCausalLM with SDPA
attention, sized to the hybrid's *total* parameter count, same vocabulary, optimizer, dtype
and tokens per step.

FLOPs per token, both models, one convention: 3 x the forward matmul FLOPs, where forward
counts 2 x every weight used in a matmul (LM head included, embedding lookup excluded) plus
attention's 4 x seq_len x (heads x head_dim) per layer (full L x L scores). For the dense
Llama this is exactly the PaLM formula 6N + 12 L d s (N = matmul weights). For the hybrid,
the analytic counter (``megacpp.model.counting``) also counts the scan's chunk terms and
only the k active experts. MFU = FLOPs/token x tokens/s / measured matmul peak: the
project's one MFU (``megacpp.contract.mfu`` over ``megacpp.train.metrics.bf16_matmul_peak``,
the figure ``megacpp train`` reports too); each row and receipt names the peak and its source.

``--out`` (default ``benchmarks/results/train_step/<device>``) gets ``train_step.json``, one
``bench`` receipt per row under ``receipts/train_step/`` and ``command.txt``. A run replaces the
folder's earlier results; with ``--add`` it keeps their rows (a row of the same model, mode and
sequence length is replaced) and adds its command, so a long sweep can be split over several
runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from megacpp.contract import capture_fingerprint, load_contract_config, require_preflight
from megacpp.contract.devices import mfu, profile_for_fingerprint
from megacpp.kernels.runtime import chosen_kernels, clear_resolutions, set_kernel_mode
from megacpp.kernels.timing import capture_graph, cuda_times_ms
from megacpp.model.config import load_config
from megacpp.model.counting import count_model
from megacpp.model.model import HybridLM, next_token_labels
from megacpp.receipts import write_receipt
from megacpp.train.metrics import PeakFlops, bf16_matmul_peak


@dataclass
class Result:
    model: str
    mode: str
    seq_len: int
    batch: int
    params: int
    active_params: int
    flops_per_token: int
    step_ms: float
    step_ms_spread: float
    tokens_per_s: float
    mfu: float
    peak_mem_gib: float
    error: str | None = None
    kernels: dict[str, str] | None = None  # the hybrid's surface -> backend, as resolved


def build_hybrid(preset: str, seq_len: int):
    cfg = load_config(preset)
    cost = count_model(cfg, seq_len=seq_len)
    model = HybridLM(cfg)

    def loss_fn(m, ids):
        return m(ids, labels=next_token_labels(ids)).loss

    return model, loss_fn, cost.params, cost.active_params, cost.train_flops_per_token, cfg


def llama_peer(target_params: int, vocab: int, d_model: int, seq_len: int):
    """A LlamaForCausalLM with about ``target_params`` parameters (tied embeddings)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = d_model // 64
    ffn = int(8 * d_model / 3 / 64 + 0.5) * 64

    def make(n_layers: int) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=vocab,
            hidden_size=d_model,
            intermediate_size=ffn,
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 4),
            max_position_embeddings=seq_len,
            tie_word_embeddings=True,
            attn_implementation="sdpa",
        )

    def count(c: LlamaConfig) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in LlamaForCausalLM(c).parameters())

    per_layer = count(make(2)) - count(make(1))
    n_layers = max(1, round((target_params - count(make(0))) / per_layer))
    cfg = make(n_layers)
    model = LlamaForCausalLM(cfg)
    params = sum(p.numel() for p in model.parameters())
    kv = cfg.num_key_value_heads * (d_model // heads)
    matmul_weights = n_layers * (2 * d_model * d_model + 2 * d_model * kv + 3 * d_model * ffn)
    matmul_weights += vocab * d_model  # LM head
    flops = 6 * matmul_weights + 12 * n_layers * d_model * seq_len

    def loss_fn(m, ids):
        logits = m(input_ids=ids, use_cache=False).logits
        return F.cross_entropy(
            logits.float().flatten(0, 1), next_token_labels(ids).flatten(), ignore_index=-100
        )

    return model, loss_fn, params, params, flops, f"llama-{n_layers}L-d{d_model}"


def compile_regions(model: torch.nn.Module) -> None:
    """Regional compile: each residual block (hybrid) / decoder layer (Llama) on its own."""
    layers = model.blocks if hasattr(model, "blocks") else model.model.layers
    for layer in layers:
        layer.compile()


def bench_one(
    name, model, loss_fn, params, active, flops, mode, seq_len, batch, peak, iters, profile=None
):
    model = model.cuda()
    if mode.startswith("compiled"):
        compile_regions(model)
    graphed = mode.endswith("graphed")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=graphed)
    vocab = model.config.vocab_size if hasattr(model, "config") else model.cfg.vocab_size
    ids = torch.randint(0, vocab, (batch, seq_len), device="cuda")

    def step():
        # a captured graph replays autocast's casts: its weight-cast cache must stay off
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=not graphed):
            loss = loss_fn(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    if graphed:
        step = capture_step(step)
    warmup = 3 if mode == "eager" else 4
    times = cuda_times_ms(step, warmup=warmup, iters=iters)
    ms = statistics.median(times)
    tok_s = batch * seq_len / (ms * 1e-3)
    peak_mem = torch.cuda.max_memory_allocated() / 2**30
    if profile is not None:
        profile_steps(step, profile)
    return Result(
        model=name,
        mode=mode,
        seq_len=seq_len,
        batch=batch,
        params=params,
        active_params=active,
        flops_per_token=flops,
        step_ms=ms,
        step_ms_spread=max(times) - min(times),
        tokens_per_s=tok_s,
        mfu=mfu(flops, tok_s, PROFILE, "bf16", peak_tflops=peak.tflops,
                peak_source=peak.source).mfu,
        peak_mem_gib=peak_mem,
        kernels=chosen_kernels(),
    )


def capture_step(step):
    """The whole training step (forward, backward, optimizer) as one CUDA graph (warm-up, a
    host-sync check and the capture: :func:`megacpp.kernels.timing.capture_graph`); the
    returned callable replays it. Removes every host launch from the step, so the step runs at
    the GPU's speed -- it needs a step with no host syncs and static shapes (fails otherwise)."""
    graph, _ = capture_graph(step)
    return graph.replay


def profile_steps(step, path: Path, steps: int = 3) -> list[dict]:
    """Profile ``steps`` training steps: write the top CUDA kernels by total device time and
    the GPU time per kernel family (:mod:`megacpp.kernels.profiling`) to ``path``; return the
    family rows (also as ``path`` with a ``.families.json`` suffix; every kernel with its
    family, calls and ms per step as ``.kernels.json``). Works on graph replays:
    the profiler sees the kernels a replayed graph runs."""
    from torch.profiler import ProfilerActivity, profile

    from megacpp.kernels.profiling import (
        device_rows,
        family_breakdown,
        format_breakdown,
        kernel_family,
    )

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    table = averages.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=90)
    rows = device_rows(averages)
    kernels = [(e.key, e.self_device_time_total) for e in rows]
    families = family_breakdown(kernels, steps=steps)
    every = [{"kernel": e.key, "family": kernel_family(e.key), "calls_per_step": e.count / steps,
              "ms_per_step": e.self_device_time_total / steps / 1e3} for e in rows]
    every.sort(key=lambda r: -r["ms_per_step"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{steps} training steps: GPU time per kernel family\n"
                    f"{format_breakdown(families)}\n\nsorted by self CUDA time\n{table}\n")
    path.with_suffix(".families.json").write_text(json.dumps(families, indent=1) + "\n")
    path.with_suffix(".kernels.json").write_text(json.dumps(every, indent=1) + "\n")
    print(format_breakdown(families), flush=True)
    return families


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--preset", default="nam56r-350m")
    ap.add_argument("--seq-len", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument(
        "--modes", nargs="+", default=["eager", "compiled"],
        choices=["eager", "compiled", "graphed", "compiled-graphed"],
        help="eager; compiled (regional torch.compile); graphed / compiled-graphed: the whole "
        "step (forward, backward, AdamW) captured once as a CUDA graph and replayed",
    )
    ap.add_argument("--models", nargs="+", default=["hybrid", "llama"], choices=["hybrid", "llama"])
    ap.add_argument(
        "--kernels", nargs="+", default=["reference"], choices=["reference", "auto", "fast"],
        help="kernel modes for the hybrid (MEGACPP_KERNELS); each is its own row, named "
        "PRESET (reference) or PRESET+MODE",
    )
    ap.add_argument(
        "--profile", type=Path, default=None, metavar="DIR",
        help="also profile 3 steps of each row: GPU time per kernel family and the top kernels "
        "go to DIR (host-bound rows timed after a profile run slower: on an H100 the Llama's "
        "compiled step 172 vs 146 ms; take timings from a run without it)",
    )
    ap.add_argument("--tokens-per-step", type=int, default=16384)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None,
                    help="results folder (default: benchmarks/results/train_step/<device>)")
    ap.add_argument("--add", action="store_true",
                    help="keep the rows of an earlier run in --out (and add this command)")
    ap.add_argument("--skip-preflight", action="append", default=[], metavar="RULE")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/train_step.py needs a CUDA GPU")
    facts = capture_fingerprint()
    preflight = require_preflight(facts, load_contract_config(None), skip=args.skip_preflight)
    args.out = start_results(args.out, args.add)

    torch.backends.cuda.matmul.allow_tf32 = True
    global PROFILE
    PROFILE = profile_for_fingerprint(facts)
    peak = bf16_matmul_peak(torch.device("cuda", torch.cuda.current_device()), PROFILE)
    if peak.tflops is None:
        sys.exit(f"no bf16 peak to divide by: {peak.source}")
    print(f"device: {torch.cuda.get_device_name()}  MFU peak: {peak.tflops:.0f} TFLOP/s "
          f"({peak.source})", flush=True)
    results: list[Result] = []
    cfg = load_config(args.preset)
    hybrid_shape = (count_model(cfg).params, cfg.vocab_size, cfg.d_model)
    for mode in args.modes:  # all eager rows first: they are cheap and never compile
        for seq_len in args.seq_len:
            batch = max(1, args.tokens_per_step // seq_len)
            rows = [("hybrid", k) for k in args.kernels if "hybrid" in args.models]
            rows += [("llama", None)] if "llama" in args.models else []
            for which, kernels in rows:
                torch.manual_seed(0)
                clear_resolutions()  # so each row's receipt names only its own kernels
                profile = None
                if which == "hybrid":
                    set_kernel_mode(kernels)
                    model, loss_fn, params, active, flops, _ = build_hybrid(args.preset, seq_len)
                    name = args.preset if kernels == "reference" else f"{args.preset}+{kernels}"
                    if args.profile:
                        profile = args.profile / f"{name}_{mode}_L{seq_len}.txt"
                else:
                    model, loss_fn, params, active, flops, name = llama_peer(*hybrid_shape, seq_len)
                    if args.profile:
                        profile = args.profile / f"{name}_{mode}_L{seq_len}.txt"
                t0 = time.perf_counter()
                try:
                    r = bench_one(
                        name,
                        model,
                        loss_fn,
                        params,
                        active,
                        flops,
                        mode,
                        seq_len,
                        batch,
                        peak,
                        args.iters,
                        profile,
                    )
                except Exception as exc:  # noqa: BLE001 -- OOM, or a backend that cannot run here
                    nan = float("nan")
                    kind = "OOM" if isinstance(exc, torch.OutOfMemoryError) else type(exc).__name__
                    r = Result(
                        name, mode, seq_len, batch, params, active, flops,
                        nan, nan, nan, nan, nan, error=f"{kind}: {exc}"[:300],
                    )
                print(
                    f"{r.model:>22} {mode:>8} L={seq_len:<5} B={batch:<3} "
                    f"{r.step_ms:8.1f} ms  {r.tokens_per_s:9.0f} tok/s  MFU {100 * r.mfu:5.1f}%  "
                    f"mem {r.peak_mem_gib:5.1f} GiB  ({time.perf_counter() - t0:.0f}s)"
                    f"{' ' + r.error if r.error else ''}",
                    flush=True,
                )
                results.append(r)
                del model
                gc.collect()
                torch.cuda.empty_cache()
                torch._dynamo.reset()
                # each row is saved (and receipted) as soon as it is measured
                save_row(args.out, r, peak, preflight, facts)

    print(f"results: {args.out / 'train_step.json'}")


FLOP_FORMULA = "3 x forward matmul FLOPs (6N + 12*L*d*s for the dense peer)"


PROFILE = None  # the device profile MFU is named by (set in main)


def start_results(out: Path | None, add: bool) -> Path:
    """The results folder, with this run's command: a fresh start (the earlier files of this
    benchmark removed) or, with ``add``, the earlier rows kept and the command appended."""
    from megacpp.receipts.results import begin, command_line, results_dir

    out = out or results_dir("train_step")
    if not add:
        return begin(out, "train_step", "train_step")
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "command.txt", "a") as commands:
        commands.write(command_line() + "\n")
    return out


def save_row(out: Path, r: Result, peak: PeakFlops, preflight, facts) -> None:
    """Merge ``r`` into ``out/train_step.json`` (keyed by model, mode, seq_len) and write its
    receipt. Rows with other keys are kept (each row records the matmul peak measured in its
    own run)."""
    results = out / "train_step.json"
    payload = json.loads(results.read_text()) if results.exists() else {"results": []}
    row = {**r.__dict__, "matmul_peak_tflops": peak.tflops, "mfu_peak_source": peak.source,
           "device": torch.cuda.get_device_name()}
    key = (r.model, r.mode, r.seq_len)
    rows = [x for x in payload["results"] if (x["model"], x["mode"], x["seq_len"]) != key]
    payload.update(torch=torch.__version__, flop_formula=FLOP_FORMULA, results=rows + [row])
    results.write_text(json.dumps(payload, indent=2) + "\n")
    if r.error:
        return
    config = {
        "benchmark": "train_step",
        "model": r.model,
        "mode": r.mode,
        "seq_len": r.seq_len,
        "batch": r.batch,
        "dtype": "bf16-autocast",
        "optimizer": "AdamW(fused)",
        "kernels": r.kernels,
        "flop_formula": FLOP_FORMULA,
        "mfu_peak_source": peak.source,
    }
    metrics = {
        k: float(getattr(r, k))
        for k in ("tokens_per_s", "step_ms", "mfu", "peak_mem_gib", "flops_per_token")
    }
    metrics["matmul_peak_tflops"] = peak.tflops
    receipt = out / "receipts" / "train_step" / f"{r.model}_{r.mode}_L{r.seq_len}.json"
    write_receipt(receipt, "bench", config, metrics, preflight=preflight, fingerprint=facts)


if __name__ == "__main__":
    main()
