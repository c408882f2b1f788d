"""How long a LoRA adapter takes to load into a running server (and to unload).

Run::

    .venv/bin/python benchmarks/lora_load.py --preset tiny --rank 8 --device cpu --out /tmp/lora
    .venv/bin/python benchmarks/lora_load.py --preset nam56r-small --rank 16 --device cuda \\
        --out /tmp/lora

A random-init model of the preset is the base; a rank-``--rank`` adapter over every linear
LoRA supports (random, non-zero) is written in peft's format. Each repeat times what
``POST /v1/load_lora_adapter`` does -- merge the adapter into a copy of the base, build its
engine, start its thread -- and what unload does (stop the thread). The median and every
run are printed and written to ``OUT/lora_load.json`` with a receipt (kind ``bench``). The
target: under 1 s for a small adapter.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from megacpp.data.tokenizer import CppTokenizer, train_tokenizer
from megacpp.infer.adapters import AdapterSet
from megacpp.infer.async_engine import AsyncEngine
from megacpp.infer.engine import Engine, EngineConfig
from megacpp.infer.jobs import Specialist
from megacpp.model.config import load_config
from megacpp.model.model import HybridLM
from megacpp.receipts import write_receipt
from megacpp.train.finetune import LoraState, adapter_state, add_lora, lora_targets, save_adapter

SNIPPET = "template <typename T> struct Box { T value; };\nint main() { return 0; }\n"


def random_adapter(base: HybridLM, rank: int, out: Path) -> Path:
    model = HybridLM(base.cfg)
    model.load_state_dict(base.state_dict())
    lora = LoraState(rank, 2.0 * rank, 0.0, tuple(lora_targets(model, ())))
    add_lora(model, lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(std=0.02)
    return save_adapter(adapter_state(model), lora, out)


async def one_load(adapters: AdapterSet, path: Path) -> tuple[float, float]:
    started = time.perf_counter()
    spec = adapters.build("bench", path)
    spec.engine.start()
    loaded = time.perf_counter()
    await spec.engine.shutdown()
    return loaded - started, time.perf_counter() - loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    tok = CppTokenizer.from_hf(train_tokenizer([SNIPPET * 50], vocab_size=300))
    cfg = dataclasses.replace(load_config(args.preset), vocab_size=tok.vocab_size)
    torch.manual_seed(0)
    base = HybridLM(cfg)
    state = {k: v.clone() for k, v in base.state_dict().items()}
    config = EngineConfig(max_num_seqs=8, max_model_len=512)
    spec = Specialist("base", AsyncEngine(Engine(HybridLM(cfg), tok, config, device, dtype),
                                          "base"), tok, config.max_model_len)
    adapters = AdapterSet.of(spec, state)
    with tempfile.TemporaryDirectory() as tmp:
        path = random_adapter(base, args.rank, Path(tmp) / "adapter")
        adapter_bytes = sum(f.stat().st_size for f in path.iterdir())
        runs = [asyncio.run(one_load(adapters, path)) for _ in range(args.repeat)]
    loads, unloads = [r[0] for r in runs], [r[1] for r in runs]
    result = {"preset": args.preset, "rank": args.rank, "device": str(device),
              "dtype": str(dtype), "parameters": sum(p.numel() for p in base.parameters()),
              "adapter_bytes": adapter_bytes, "load_s_median": statistics.median(loads),
              "unload_s_median": statistics.median(unloads), "load_s": loads,
              "unload_s": unloads}
    print(json.dumps(result, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "lora_load.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    write_receipt(args.out / "lora_load.receipt.json", "bench",
                  config={k: result[k] for k in ("preset", "rank", "device", "dtype")},
                  metrics={"load_s_median": result["load_s_median"],
                           "unload_s_median": result["unload_s_median"]}, artifacts=[out])


if __name__ == "__main__":
    main()
