"""The GPU suite's outcome as data: per run (a group), pytest's counts, wall time, failed tests.

    python scripts/gpu_tests_summary.py --out benchmarks/results/gpu_tests/h100/gpu_tests.json \\
        LOG_GROUP1 LOG_GROUP2 ...

Each LOG is the output of one `bash scripts/gpu_tests.sh G N` (or `pytest -m gpu ...`) run;
the summary reads pytest's final line (`3 failed, 26 passed, ... in 213.31s`) and its
`FAILED <test>` lines, and marks a run stopped before its end (`interrupted`), so the logs
themselves need not be kept.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)")
WALL = re.compile(r" in ([\d.]+)s")


def summarize(text: str) -> dict:
    """Counts, wall seconds and failed test ids of one pytest run's output."""
    finals = [line for line in text.splitlines()
              if COUNT.search(line) and WALL.search(line) and not line.startswith("FAILED")]
    if not finals:
        raise ValueError("no pytest summary line (the run was cut off before it finished)")
    final = finals[-1]
    counts = {("errors" if kind.startswith("error") else kind): int(n)
              for n, kind in COUNT.findall(final)}
    failed = sorted({line.split()[1] for line in text.splitlines()
                     if line.startswith(("FAILED ", "ERROR "))})
    interrupted = "KeyboardInterrupt" in text or "!! Interrupted" in text
    return {"counts": counts, "wall_s": float(WALL.search(final).group(1)), "failed": failed,
            "interrupted": interrupted}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", type=Path, nargs="+")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    groups = {}
    for log in args.logs:
        try:
            groups[log.stem] = summarize(log.read_text(errors="replace"))
        except (OSError, ValueError) as exc:
            print(f"error: {log}: {exc}", file=sys.stderr)
            return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "gpu_tests", "runs": groups}, indent=2) + "\n")
    for name, group in groups.items():
        print(f"{name}: {group['counts']}{' (interrupted)' if group['interrupted'] else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
