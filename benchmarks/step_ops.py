"""Which host op launched each kernel of a training step: GPU time per (op, input shapes),
for the glue kernels the family breakdown of ``train_step.py --profile`` cannot
place (copies, casts, eager adds and sums between compiled regions and opaque kernels).

Runs the hybrid's step compiled (regional torch.compile, as ``train_step.py``) but *not*
graphed: a replayed CUDA graph keeps no link from a kernel to the op that launched it. Its
kernels are the graphed step's (the same ops run; graphs only remove the launch gaps). Run on
a GPU::

    PYTHONPATH=src python benchmarks/step_ops.py --preset nam56r-350m --seq-len 2048 \
        --kernels fast --out DIR

writes DIR/step_ops.txt (the table) and DIR/step_ops.json (every row). A row is one
(op, input shapes): its self GPU time per step, calls per step and its kernels. Inductor's
kernels show under their own names, our Triton ops under their autograd Function's. (The
profiler's Python stacks are empty for these ops under torch 2.11 on an H100, so no call
sites: the shapes place them.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from train_step import build_hybrid, compile_regions

from megacpp.kernels.runtime import clear_resolutions, set_kernel_mode


def attribute(prof, steps: int) -> list[dict]:
    """One row per (op, input shapes) with self device time, innermost op only."""
    rows: dict[tuple, dict] = {}
    for evt in prof.events():
        own = getattr(evt, "self_device_time_total", 0.0)
        if own <= 0 or evt.device_type != torch.autograd.DeviceType.CPU:
            continue
        key = (evt.name, str(evt.input_shapes))
        row = rows.setdefault(key, {"op": evt.name, "shapes": key[1], "ms_per_step": 0.0,
                                    "calls_per_step": 0.0, "kernels": set()})
        row["ms_per_step"] += own / steps / 1e3
        row["calls_per_step"] += 1 / steps
        row["kernels"].update(k.name[:60] for k in evt.kernels)
    out = sorted(rows.values(), key=lambda r: -r["ms_per_step"])
    for r in out:
        r["kernels"] = sorted(r["kernels"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="nam56r-350m")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--tokens-per-step", type=int, default=16384)
    ap.add_argument("--kernels", default="fast", choices=["reference", "auto", "fast"])
    ap.add_argument("--steps", type=int, default=2, help="profiled steps (after 4 warm-up)")
    ap.add_argument("--rows", type=int, default=60, help="rows of the printed table")
    ap.add_argument("--out", type=Path, required=True, help="directory for the table and JSON")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/step_ops.py needs a CUDA GPU")
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    clear_resolutions()
    set_kernel_mode(args.kernels)
    model, loss_fn, *_ = build_hybrid(args.preset, args.seq_len)
    model = model.cuda()
    compile_regions(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batch = max(1, args.tokens_per_step // args.seq_len)
    ids = torch.randint(0, model.cfg.vocab_size, (batch, args.seq_len), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(4):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True,
                 with_stack=False) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    rows = attribute(prof, args.steps)
    total = sum(r["ms_per_step"] for r in rows)
    head = (f"{args.preset}+{args.kernels} L={args.seq_len} B={batch}, compiled (not graphed), "
            f"{args.steps} steps: {total:.2f} ms of GPU time per step attributed to host ops")
    lines = [head, f"{'ms/step':>8} {'calls':>6}  op  [input shapes]  {{kernels}}"]
    for r in rows[: args.rows]:
        lines.append(f"{r['ms_per_step']:8.3f} {r['calls_per_step']:6.1f}  {r['op']}  "
                     f"{r['shapes'][:140]}  {{{', '.join(r['kernels'])[:160]}}}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_ops.txt").write_text("\n".join(lines) + "\n")
    (args.out / "step_ops.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
