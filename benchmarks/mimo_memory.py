"""What one M:mimo mixer keeps for backward: bytes saved by autograd in its training forward.

Builds one ``Mamba3MimoMixer`` from a preset's ``[mamba]`` section (default
nam56r-dense-150m: d_model 768, 24 heads x 64, N 64, R 4, chunk 16), runs its forward under
bf16 autocast on x [batch, seq, d_model] with a gradient, and counts every storage autograd
saves (each once; parameters and x excluded) with
:func:`megacpp.kernels.recompute.saved_tensor_bytes`: the whole mixer, and the scan call
alone. Runs on the CPU (the reference backend, or ``triton_intra`` under the Triton
interpreter: set ``TRITON_INTERPRET=1``) or a GPU. Saved bytes are a fixed part
(autocast's bf16 copies of the weights) plus a part linear in batch * seq (every other saved
tensor is per token or per chunk), so two lengths (``--seq`` and twice it) give both and
extrapolate to the training shape (``--to-batch``, ``--to-seq``, ``--layers``): the printed
extrapolation is arithmetic, not a measurement. ::

    PYTHONPATH=src python benchmarks/mimo_memory.py --batch 1 --seq 256
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/mimo_memory.py --backend triton_intra \
        --batch 1 --seq 64

``--stack N`` instead runs N mixers as a residual stack (forward and backward, batch x seq,
bf16 autocast) and prints the process's peak resident memory above the built model (Linux
``ru_maxrss``, CPU): the end-to-end figure, backward's replay included, not a count of saved
tensors. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import megacpp.model.mamba3_mimo as mimo_module
from megacpp.kernels.recompute import saved_tensor_bytes
from megacpp.model.config import load_config
from megacpp.model.mamba3_mimo import Mamba3MimoMixer

MIB = 2**20


def measure(mixer: Mamba3MimoMixer, x: torch.Tensor, backend: str) -> dict[str, int]:
    """Saved bytes of the mixer's forward and of its scan call (one forward)."""
    if backend == "triton_intra":
        if os.environ.get("TRITON_INTERPRET") == "1":  # numpy 2.4 vs the interpreter
            sys.path.insert(0, str(ROOT))
            from tests.kernels.interpreter import patch_scalar_index
            patch_scalar_index()
        from megacpp.kernels.ops.mamba3_mimo_scan.triton import mamba3_mimo_scan_triton
        scan_fn = mamba3_mimo_scan_triton
    else:
        from megacpp.kernels.ops.mamba3_mimo_scan.reference import mamba3_mimo_scan_chunked
        scan_fn = mamba3_mimo_scan_chunked
    exclude = (x, *mixer.parameters())
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        inputs = {n: t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor)
                  else t for n, t in mixer._scan_inputs(x).items()}
        with saved_tensor_bytes(exclude) as scan_saved:  # counts the inputs it keeps
            scan_fn(**inputs, chunk_size=mixer.chunk_size, output_final_state=False)
        # this backend on any device (the catalog picks triton_intra on CUDA only)
        mimo_module.resolve = lambda surface, like: SimpleNamespace(fn=scan_fn)
        with saved_tensor_bytes(exclude) as mixer_saved:
            y = mixer(x)
    y.float().square().mean().backward()  # the saved tensors are usable
    return {"mixer_bytes": mixer_saved["bytes"], "mixer_tensors": mixer_saved["tensors"],
            "scan_bytes": scan_saved["bytes"], "scan_tensors": scan_saved["tensors"]}


def stack_peak_rss(mixers: list[Mamba3MimoMixer], x: torch.Tensor) -> dict[str, float]:
    """Peak resident MiB above the current peak for a residual stack's forward + backward."""
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        h = x
        for mixer in mixers:
            h = h + mixer(h)
    h.float().square().mean().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"layers": len(mixers), "peak_rss_above_model_mib": round((peak - base) / 2**10)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="nam56r-dense-150m")
    ap.add_argument("--backend", choices=("reference", "triton_intra"), default="reference")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--to-batch", type=int, default=8)
    ap.add_argument("--to-seq", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=14, help="M:mimo layers in the model")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--stack", type=int, default=0,
                    help="run this many mixers as a stack and print peak RSS (CPU) instead")
    args = ap.parse_args()

    cfg = load_config(args.preset)
    if args.stack:
        torch.manual_seed(0)
        mixers = [Mamba3MimoMixer.from_config(cfg) for _ in range(args.stack)]
        x = torch.randn(args.batch, args.seq, cfg.d_model, requires_grad=True)
        print(json.dumps({"preset": args.preset, "batch": args.batch, "seq": args.seq,
                          **stack_peak_rss(mixers, x)}))
        return
    torch.manual_seed(0)
    mixer = Mamba3MimoMixer.from_config(cfg).to(args.device)
    # two lengths: saved bytes = fixed (autocast's bf16 weight copies) + per token * tokens
    runs = []
    for seq in (args.seq, 2 * args.seq):
        x = torch.randn(args.batch, seq, cfg.d_model, device=args.device, requires_grad=True)
        runs.append(measure(mixer, x, args.backend))
    tokens = args.batch * args.seq
    per_token = {k: (runs[1][k] - runs[0][k]) / tokens for k in ("mixer_bytes", "scan_bytes")}
    fixed = {k: runs[0][k] - per_token[k] * tokens for k in per_token}
    to_tokens = args.to_batch * args.to_seq

    def at_target(key: str) -> float:
        return fixed[key] + per_token[key] * to_tokens

    result = {
        "preset": args.preset, "backend": args.backend, "device": args.device,
        "batch": args.batch, "seqs": [args.seq, 2 * args.seq], "measured": runs,
        "mixer_bytes_per_token": per_token["mixer_bytes"], "mixer_fixed_bytes": fixed[
            "mixer_bytes"], "scan_bytes_per_token": per_token["scan_bytes"],
        "extrapolated_to": f"batch {args.to_batch} x seq {args.to_seq}, {args.layers} layers",
        "extrapolated_mixer_mib_per_layer": round(at_target("mixer_bytes") / MIB, 1),
        "extrapolated_scan_mib_per_layer": round(at_target("scan_bytes") / MIB, 1),
        "extrapolated_mixers_gib": round(at_target("mixer_bytes") * args.layers / 2**30, 2),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
