"""One line for a `megacpp train` run's metrics.jsonl: the median step time of steps 9-30,
tokens/s (16384 tokens a step), the losses of steps 4 and 30, the first grad norm, validation."""

import json
import statistics
import sys

rows = [json.loads(line) for line in open(sys.argv[1])]
val = [r["val_loss"] for r in rows if r["type"] == "val"]
train = [r for r in rows if r["type"] == "train"]
t = statistics.median(r["time_s"] for r in train if r["step"] >= 9)
print(f"steps 9-30 median {1e3 * t:.1f} ms, {16384 / t:,.0f} tokens/s, loss step 4 "
      f"{train[3]['loss']:.4f} step 30 {train[-1]['loss']:.4f}, grad norm step 1 "
      f"{train[0]['grad_norm']:.1f}, val {val}")
