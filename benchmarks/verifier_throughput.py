"""Verifier throughput: HumanEval-X reference solutions compiled and run in the sandbox.

Run (docs/eval.md quotes its numbers on a 2-core machine)::

    PYTHONPATH=src python benchmarks/verifier_throughput.py --workers 2

For each build configuration, every selected problem's canonical solution goes through the
full verifier (sandboxed g++, then the sandboxed binary) on ``--workers`` threads:

* ``plain``: g++ -std=c++17 -O0, default linker (bfd);
* ``gold``: the same, linked with gold;
* ``pch (warm)`` / ``pch + gold (warm)``: precompiled leading-include blocks, cache warm;
* ``pch + gold (cold)``: the same with an empty cache, so the PCH builds are included.

Reported per configuration: programs per second (wall), median compile and run wall time
per program, and CPU-seconds per program (user + system of every sandboxed process, from
RUSAGE_CHILDREN), which other users' load on a shared machine disturbs much less than wall
time. The load average before and after is recorded with the numbers. ``--out`` (default
``benchmarks/results/verifier_throughput/cpu``) gets ``verifier_throughput.json``, its evidence
receipt (kind ``bench``) under ``receipts/verifier_throughput/`` and ``command.txt``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from rich.console import Console
from rich.table import Table

from megacpp.eval import (
    CppVerifier,
    Sandbox,
    humaneval_build_options,
    load_problems,
    locate_problems,
    reference_samples,
    select_problems,
    verify_samples,
)
from megacpp.receipts import write_receipt
from megacpp.receipts.results import begin, results_dir

CONFIGS = {  # name -> (pch, linker, fresh cache)
    "plain": (False, None, False),
    "gold": (False, "gold", False),
    "pch + gold (cold)": (True, "gold", True),
    "pch (warm)": (True, None, False),
    "pch + gold (warm)": (True, "gold", False),
}


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(name: str, problems, workers: int, sandbox: Sandbox, sanitize: bool) -> dict[str, Any]:
    pch, linker, fresh_cache = CONFIGS[name]
    samples = reference_samples(problems)
    with tempfile.TemporaryDirectory(prefix="megacpp-bench-cache-") as empty_cache:
        previous_cache = os.environ.get("MEGACPP_CACHE_DIR")
        if fresh_cache:
            os.environ["MEGACPP_CACHE_DIR"] = empty_cache
        try:
            verifier = CppVerifier(humaneval_build_options(pch=pch, linker=linker,
                                                           sanitize=sanitize), sandbox)
            if pch and not fresh_cache:  # warm: build the precompiled headers first, untimed
                verify_samples(verifier, problems, samples, workers=workers)
            cpu_before, started = children_cpu_s(), time.monotonic()
            results = verify_samples(verifier, problems, samples, workers=workers)
            wall_s, cpu_s = time.monotonic() - started, children_cpu_s() - cpu_before
        finally:
            if previous_cache is None:
                os.environ.pop("MEGACPP_CACHE_DIR", None)
            else:
                os.environ["MEGACPP_CACHE_DIR"] = previous_cache
    verdicts = [r.verdict for r in results]
    return {
        "config": name, "pch": pch, "linker": linker or "default", "sanitize": sanitize,
        "programs": len(verdicts), "passed": sum(v.passed for v in verdicts),
        "wall_s": round(wall_s, 2), "programs_per_s": round(len(verdicts) / wall_s, 2),
        "median_compile_s": round(statistics.median(v.compile_s for v in verdicts), 4),
        "median_run_s": round(statistics.median(v.run_s for v in verdicts if v.run_s), 4),
        "cpu_s_per_program": round(cpu_s / len(verdicts), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", type=Path, default=None)
    parser.add_argument("--limit", type=int, default=None, help="only the first N problems")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--sanitize", action="store_true", help="ASan + UBSan builds")
    parser.add_argument("--out", type=Path,
                        default=results_dir("verifier_throughput", "cpu",
                                            ROOT / "benchmarks" / "results"),
                        help="results folder (default: benchmarks/results/verifier_throughput/cpu)")
    args = parser.parse_args()

    console = Console(stderr=True)
    problem_file = locate_problems(args.problems)
    problems = select_problems(load_problems(problem_file), limit=args.limit)
    sandbox = Sandbox()
    begin(args.out, "verifier_throughput", "verifier_throughput")
    load_before = os.getloadavg()
    rows = []
    for name in args.configs:
        rows.append(measure(name, problems, args.workers, sandbox, args.sanitize))
        row = rows[-1]
        console.print(f"{name}: {row['programs_per_s']} programs/s, median compile "
                      f"{row['median_compile_s']} s, {row['cpu_s_per_program']} CPU-s/program")

    table = Table("config", "passed", "programs/s", "median compile s", "median run s",
                  "CPU-s/program", title=f"verifier throughput, {args.workers} workers")
    for row in rows:
        table.add_row(row["config"], f"{row['passed']}/{row['programs']}",
                      str(row["programs_per_s"]), str(row["median_compile_s"]),
                      str(row["median_run_s"]), str(row["cpu_s_per_program"]))
    Console().print(table)

    result = {"benchmark": "verifier_throughput", "workers": args.workers, "cpus": os.cpu_count(),
              "isolation": sandbox.isolation.value, "problem_file": str(problem_file),
              "loadavg_before": [round(x, 2) for x in load_before],
              "loadavg_after": [round(x, 2) for x in os.getloadavg()], "rows": rows}
    out = args.out / "verifier_throughput.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    best = max(rows, key=lambda row: row["programs_per_s"])
    receipt = args.out / "receipts" / "verifier_throughput" / "verifier_throughput.receipt.json"
    write_receipt(receipt, "bench",
                  config={k: v for k, v in result.items() if k != "rows"},
                  metrics={"programs_per_s": best["programs_per_s"],
                           "median_compile_s": best["median_compile_s"],
                           "median_run_s": best["median_run_s"]},
                  artifacts=[out])
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
