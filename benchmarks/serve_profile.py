"""``serve_decode.py --profile``: where one engine decode step's time goes.

Per batch size ``B``: ``B`` prompts are prefilled and decoded until every row decodes and
the decode graphs are captured, then ``--profile-steps`` decode steps run under
``torch.profiler`` twice:

0. first, the step that prefills all ``B`` prompts, as served (prefill graphs) and eagerly:
   its wall time, host launches and device kernels, the served step's top kernels, and the
   eager step's device time per block family (blocks labelled as in 2);
1. as served (captured CUDA graphs): wall time per step, host launches per step
   (``cudaLaunchKernel``-like calls, ``cudaGraphLaunch``, async copies), device kernels per
   step, and each kernel name's device time per step;
2. eagerly, each block inside a ``record_function`` named after its family (``A``, ``E``,
   ``M``, ``R``, ``D``): device time per family per step (a replayed graph hides that split).

The weight bytes one decode step reads are counted from the model, not measured: every
parameter of the serving forward once (the MoE decode step runs every expert densely), but
an untied embedding table only for the ``B`` rows looked up; the M/R states are read and
written, the KV pages read up to each row's length. ``ncu --metrics dram__bytes_read.sum``
measures the real DRAM traffic (see docs/serving.md). Writes ``profile_B<B>.json`` and
``profile_B<B>.txt`` to the results folder.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from megacpp.infer.engine import Engine, EngineConfig
from megacpp.infer.sampling import SamplingParams
from megacpp.model.config import load_config
from megacpp.model.model import HybridLM, paged_layer

HOST_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                 "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")
WARM_STEPS = 4  # decode steps before profiling: every row decodes, its graph bucket captured


def profile_engine(args, device: torch.device, dtype: torch.dtype, tok, batch: int,
                   out: Path) -> dict:
    steps = args.profile_steps
    new_tokens = WARM_STEPS + 2 * steps + 4
    cfg = load_config(args.preset)
    torch.manual_seed(0)
    model = HybridLM(cfg)
    config = EngineConfig(max_num_seqs=batch, block_size=args.block_size,
                          max_model_len=args.prompt_len + new_tokens,
                          prefill_chunk=max(args.prefill_chunk, batch * args.prompt_len),
                          max_waiting=batch, prefill_graphs=args.prefill_graphs,
                          prefill_graph_tokens=args.prefill_graph_tokens)
    engine = Engine(model, tok, config, device=device, dtype=dtype)
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    vocab = min(cfg.vocab_size, tok.vocab_size)
    prompts = [[tok.bos_id, *torch.randint(16, vocab, (args.prompt_len - 1,), generator=g).tolist()]
               for _ in range(batch)]
    prefill = _profile_prefills(engine, prompts, params, device)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params)
    produced: dict[str, int] = defaultdict(int)
    while len(produced) < batch or min(produced.values()) < WARM_STEPS:
        for o in engine.step():
            produced[o.request_id] += len(o.new_token_ids)
    served = _profile_steps(engine, steps, device)
    graphs, engine.graphs = engine.graphs, None  # eager decode, blocks labelled
    engine.model.residual_paged = _labelled_residual(engine.model.residual_paged)
    try:
        eager = _profile_steps(engine, steps, device)
    finally:
        del engine.model.residual_paged  # the class's method again
        engine.graphs = graphs
    context = sum(len(s.token_ids) for s in engine.sequences.values()) / batch
    result = {
        "batch": batch, "prompt_len": args.prompt_len, "steps": steps,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."), "preset": args.preset,
        "prefill": prefill,
        "served": _summary(served, steps),
        "eager_by_family_ms_per_step": _families(eager, steps),
        "eager_step_ms": eager["wall_s"] / steps * 1e3,
        "bytes": _bytes_per_step(engine, batch, context, served["wall_s"] / steps),
    }
    (out / f"profile_B{batch}.json").write_text(json.dumps(result, indent=2) + "\n")
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = served["prof"].key_averages().table(sort_by=sort, row_limit=40)
    (out / f"profile_B{batch}.txt").write_text(_text(result) + "\n\n" + table + "\n")
    print(_text(result), flush=True)
    return result


def _profile_prefills(engine: Engine, prompts: list[list[int]], params: SamplingParams,
                      device: torch.device) -> dict:
    """The step that prefills every prompt (one step: the budget holds them all), profiled as
    served (prefill graphs where on) and eagerly, each after an unprofiled warm-up of its own
    (the graphs' capture, the eager path's first-call costs); the requests are aborted after
    each step."""
    out = {}
    graphs = engine.runner.prefill_graphs
    for mode in ("served", "eager"):
        engine.runner.prefill_graphs = graphs if mode == "served" else None
        if mode == "eager":  # blocks labelled by family, as in the eager decode pass
            engine.model.residual_paged = _labelled_residual(engine.model.residual_paged)
        try:
            for attempt in ("warm", "profiled"):
                ids = [f"{mode}-{attempt}-{i}" for i in range(len(prompts))]
                for rid, prompt in zip(ids, prompts, strict=True):
                    engine.add_request(rid, prompt, params)
                run = _profile_steps(engine, 1, device, check_rows=False)
                for rid in ids:
                    engine.abort(rid)
                engine.step()  # reports the aborts
        finally:
            if mode == "eager":
                del engine.model.residual_paged  # the class's method again
        out[mode] = _summary(run, 1)
        if mode == "eager":
            out[mode].pop("top_kernels")
            out[mode]["by_family_ms"] = _families(run, 1)
        else:
            out[mode]["top_kernels"] = out[mode]["top_kernels"][:10]
        out[mode]["step_ms"] = run["wall_s"] * 1e3
    engine.runner.prefill_graphs = graphs
    out["graphs"] = graphs is not None
    return out


def _profile_steps(engine: Engine, steps: int, device: torch.device,
                   check_rows: bool = True) -> dict:
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            with record_function("decode_step"):
                outputs = engine.step()
            if check_rows:
                assert len(outputs) == len(engine.sequences), "a row did not decode"
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    return {"prof": prof, "wall_s": wall}


def _labelled_layer(block, pool, x, batch):
    """:func:`paged_layer` inside a ``record_function`` named after the block's family."""
    with record_function(f"block {block.family}"):
        return paged_layer(block, pool, x, batch)


def _labelled_residual(residual_paged):
    """``HybridLM.residual_paged`` (the main stack of a prefill or decode forward) with
    :func:`_labelled_layer` as the default layer function."""

    def labelled(input_ids, layers, batch, layer_fn=None):
        return residual_paged(input_ids, layers, batch, layer_fn or _labelled_layer)

    return labelled


ANNOTATIONS = ("decode_step", "block ")  # our record_function names (also on the GPU track)


def _summary(run: dict, steps: int) -> dict:
    launches: dict[str, float] = defaultdict(float)
    kernels: dict[str, list[float]] = defaultdict(list)  # name -> device us of each call
    for evt in run["prof"].events():
        if evt.device_type == DeviceType.CPU and evt.name in HOST_LAUNCHES:
            launches[evt.name] += 1 / steps
        elif evt.device_type == DeviceType.CUDA and not evt.name.startswith(ANNOTATIONS):
            kernels[evt.name].append(evt.device_time_total)
    top = sorted(kernels.items(), key=lambda kv: sum(kv[1]), reverse=True)[:25]
    return {
        "step_ms": run["wall_s"] / steps * 1e3,
        "host_launches_per_step": dict(launches),
        "host_launch_calls_per_step": sum(launches.values()),
        "device_kernels_per_step": sum(len(v) for v in kernels.values()) / steps,
        "device_busy_ms_per_step": sum(sum(v) for v in kernels.values()) / steps / 1e3,
        "top_kernels": [{"name": name[:120], "calls_per_step": len(times) / steps,
                         "device_ms_per_step": sum(times) / steps / 1e3}
                        for name, times in top],
    }


def _families(run: dict, steps: int) -> dict[str, float]:
    """Per block family, ms per step: the device time of the kernels each block launched
    (the CPU time of its ops where nothing ran on CUDA)."""
    out: dict[str, float] = defaultdict(float)
    for evt in run["prof"].events():
        if evt.device_type == DeviceType.CPU and evt.name.startswith("block "):
            t = evt.device_time_total or evt.cpu_time_total
            out[evt.name.removeprefix("block ")] += t / steps / 1e3
    return dict(out)


def _bytes_per_step(engine: Engine, batch: int, context: float, step_s: float) -> dict:
    model = engine.model
    head = model._head_weight()
    total = read = 0
    for name, p in model.named_parameters():
        if name.startswith("mtp"):
            continue  # not in the serving forward
        nbytes = p.numel() * p.element_size()
        total += nbytes
        is_table = p.ndim == 2 and "embed" in name and p is not head
        read += batch * p.shape[1] * p.element_size() if is_table else nbytes
    state = kv = 0
    for block in model.blocks:
        mixer = block.mixer
        state += 2 * mixer.state_bytes(batch, torch.float32)  # gathered and scattered back
        kv += int(batch * context) * mixer.cache_bytes_per_token(engine.dtype)
    moved = read + state + kv
    return {
        "weights_bytes": total,
        "weights_read_per_step": read,
        "weights_read_per_token": read / batch,
        "weights_read_per_token_over_size": read / batch / total,
        "state_bytes_per_step": state,
        "kv_read_per_step": kv,
        "implied_gb_s": moved / step_s / 1e9,
    }


def _text(r: dict) -> str:
    s, b = r["served"], r["bytes"]
    launches = {k: round(v, 1) for k, v in s["host_launches_per_step"].items()}
    families = ", ".join(f"{k} {v:.3f}" for k, v in sorted(r["eager_by_family_ms_per_step"].items()))
    mib = 2**20
    pre = r["prefill"]
    lines = [
        f"decode profile  B={r['batch']}  {r['preset']}  {r['dtype']}  on {r['device']}",
        (f"prefill step of {r['batch']} x {r['prompt_len']} tokens: served "
         f"{pre['served']['step_ms']:.2f} ms ({'prefill graphs' if pre['graphs'] else 'eager'},"
         f" {pre['served']['host_launch_calls_per_step']:.0f} host launch calls), eager "
         f"{pre['eager']['step_ms']:.2f} ms ({pre['eager']['host_launch_calls_per_step']:.0f})"),
        (f"prefill served: {pre['served']['device_kernels_per_step']:.0f} kernels, device busy "
         f"{pre['served']['device_busy_ms_per_step']:.2f} ms; eager device ms by family: "
         + ", ".join(f"{k} {v:.3f}" for k, v in sorted(pre['eager']['by_family_ms'].items()))),
        f"step {s['step_ms']:.3f} ms (served)  {r['eager_step_ms']:.3f} ms (eager, labelled)",
        f"host launch calls per step {s['host_launch_calls_per_step']:.1f}  {launches}",
        (f"device kernels per step {s['device_kernels_per_step']:.1f}  "
         f"device busy {s['device_busy_ms_per_step']:.3f} ms per step"),
        (f"weights {b['weights_bytes'] / mib:.1f} MiB; read per step "
         f"{b['weights_read_per_step'] / mib:.1f} MiB = per token "
         f"{b['weights_read_per_token'] / mib:.2f} MiB "
         f"({b['weights_read_per_token_over_size']:.3f} x the weights); states "
         f"{b['state_bytes_per_step'] / mib:.1f} MiB, KV {b['kv_read_per_step'] / mib:.1f} MiB; "
         f"implied {b['implied_gb_s']:.0f} GB/s"),
        f"eager device ms per step by family (CPU ms without CUDA): {families}",
        "top kernels (device ms per step, calls per step):",
    ]
    lines += [f"  {k['device_ms_per_step']:8.4f}  {k['calls_per_step']:6.1f}  {k['name']}"
              for k in pre["served"]["top_kernels"]]
    lines.insert(-len(pre["served"]["top_kernels"]),
                 "top kernels of the served prefill step (device ms, calls):")
    lines.append("top kernels of the served decode step (device ms per step, calls per step):")
    lines += [f"  {k['device_ms_per_step']:8.4f}  {k['calls_per_step']:6.1f}  {k['name']}"
              for k in s["top_kernels"][:15]]
    return "\n".join(lines)
