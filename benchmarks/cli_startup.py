"""CLI start-up: ``megacpp model describe`` against a bare ``import torch``.

Run::

    .venv/bin/python benchmarks/cli_startup.py --runs 7 --out /tmp/cli_startup.json

Each command runs ``--runs`` times in a fresh interpreter (the same Python, environment and
working directory); the median wall clock of each, their difference and every run are printed
and written as JSON. The target: describe costs at most ``import torch`` plus 1 s, which needs
the describe path to import neither ``torch._dynamo`` nor sympy (tests/cli/test_cli_consistency
checks the first on every CI run; this script measures the time).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COMMANDS = {
    "import torch": [sys.executable, "-c", "import torch"],
    "megacpp model describe NAM56R --config tiny": [
        sys.executable, "-m", "megacpp", "model", "describe", "NAM56R", "--config", "tiny"],
    "megacpp --help": [sys.executable, "-m", "megacpp", "--help"],
}


def wall_seconds(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="runs of each command")
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    runs: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for name, cmd in COMMANDS.items():  # warm the page cache once, untimed
        subprocess.run(cmd, check=True, capture_output=True, env=env)
    for _ in range(args.runs):  # interleaved, so load drifts hit every command alike
        for name, cmd in COMMANDS.items():
            runs[name].append(wall_seconds(cmd, env))
    medians = {name: statistics.median(times) for name, times in runs.items()}
    describe, torch_import = medians[list(COMMANDS)[1]], medians["import torch"]
    result = {
        "benchmark": "cli_startup",
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
        "runs": args.runs,
        "median_seconds": medians,
        "runs_seconds": runs,
        "describe_minus_import_torch_seconds": describe - torch_import,
        "target": "describe <= import torch + 1 s",
        "target_met": describe - torch_import <= 1.0,
    }
    for name, seconds in medians.items():
        print(f"{name:50s} median {seconds:6.2f} s  (runs: "
              f"{', '.join(f'{t:.2f}' for t in runs[name])})")
    print(f"describe - import torch: {describe - torch_import:+.2f} s "
          f"(target <= +1.00 s: {'met' if result['target_met'] else 'NOT met'})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
