"""Device probe: where `megacpp train`'s graphed step goes (nam56r-350m, compile + CUDA graphs,
fast kernels, AdamW + Muon). Runs the trainer (train_350m.toml beside this script, `--set`
overrides as CLI arguments) and profiles steps PROFILE_FROM + 1 .. PROFILE_FROM + PROFILED
(CPU and CUDA activity): per step the wall time, the GPU's kernel time (its busy time, kernels
do not overlap on one stream), the rest (the GPU idle: host work and syncs between the two
graphs), and the kernels by family. Writes OUT.json and the trace.

    PYTHONPATH=src python benchmarks/results/train_h100_s26/trainer_profile.py OUT.json [KEY=VALUE ...]
"""

import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from megacpp.kernels.profiling import device_rows, family_breakdown, format_breakdown
from megacpp.train.config import load_run_config
from megacpp.train.trainer import train

PROFILE_FROM, PROFILED = 10, 4


def main() -> None:
    out = Path(sys.argv[1])
    cfg = load_run_config(Path(__file__).with_name("train_350m.toml"),
                          ["parallel.compile=true", "parallel.cuda_graph=true",
                           f"train.steps={PROFILE_FROM + PROFILED + 1}", *sys.argv[2:]])
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    walls = []

    def on_record(record):
        if record["type"] != "train":
            return
        step = record["step"]
        if step == PROFILE_FROM:
            torch.cuda.synchronize()
            prof.start()
        elif PROFILE_FROM < step <= PROFILE_FROM + PROFILED:
            walls.append(record["time_s"] * 1e3)
            if step == PROFILE_FROM + PROFILED:
                torch.cuda.synchronize()
                prof.stop()

    train(cfg, on_record=on_record, show_progress=False)
    rows = device_rows(prof.key_averages())
    kernels = [(e.key, e.device_time_total) for e in rows]
    gpu_ms = sum(us for _, us in kernels) / PROFILED / 1e3
    wall_ms = sum(walls) / len(walls)
    fams = family_breakdown(kernels, steps=PROFILED)
    print(f"steps {PROFILE_FROM + 1}-{PROFILE_FROM + PROFILED}: wall {wall_ms:.1f} ms per step "
          f"({', '.join(f'{w:.1f}' for w in walls)}), GPU kernels {gpu_ms:.1f} ms, "
          f"idle {wall_ms - gpu_ms:.1f} ms (the profiler's own cost included)")
    print(format_breakdown(fams))
    cpu = sorted((e for e in prof.key_averages() if e.device_type.name == "CPU"),
                 key=lambda e: -e.cpu_time_total)[:25]
    print("largest host ops (ms per step, inclusive):")
    for e in cpu:
        print(f"  {e.key[:70]:<70} {e.cpu_time_total / PROFILED / 1e3:8.2f}  x{e.count // PROFILED}")
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "walls_ms": walls,
                               "gpu_kernel_ms": gpu_ms, "families": fams,
                               "host_ops": [(e.key, e.cpu_time_total / PROFILED / 1e3,
                                             e.count // PROFILED) for e in cpu]}, indent=1))
    prof.export_chrome_trace(str(out.with_suffix(".trace.json")))


if __name__ == "__main__":
    main()
