"""Per-kernel time and DRAM traffic from Nsight Compute's details page (``ncu --import R
--page details``): each kernel's duration, its DRAM bytes (the Memory Workload Analysis
throughput times the duration), and its DRAM throughput as a share of peak; kernels of one name
summed. Prints a markdown table and the totals, optionally leaving out kernels whose name has
any of the words after ``--skip``.

    python benchmarks/results/kernels/h100_s34/ncu_table.py DETAILS.txt [--skip distribution]
"""

import re
import sys
from collections import defaultdict

HEAD = re.compile(r"\n  (?=\S[^\n]*\(\d+, \d+, \d+\)x\(\d+, \d+, \d+\))")
SCALE_US = {"ms": 1000.0, "us": 1.0, "ns": 1e-3}
SCALE_GBS = {"byte": 1e-9, "Kbyte": 1e-6, "Mbyte": 1e-3, "Gbyte": 1.0, "Tbyte": 1000.0}


def kernels(text: str) -> list[tuple[str, float, float, float]]:
    """(name, microseconds, DRAM megabytes, DRAM % of peak) per profiled launch."""
    rows = []
    for block in HEAD.split(text)[1:]:
        name = block.split(" (", 1)[0].strip()
        dur = re.search(r"Duration\s+(\w+)\s+([\d,.]+)", block)
        rate = re.search(r"Memory Throughput\s+(\w*byte)/s\s+([\d,.]+)", block)
        pct = re.search(r"DRAM Throughput\s+%\s+([\d.]+)", block)
        if not (dur and rate and pct):
            continue
        us = float(dur.group(2).replace(",", "")) * SCALE_US[dur.group(1)]
        gbs = float(rate.group(2).replace(",", "")) * SCALE_GBS[rate.group(1)]
        rows.append((name, us, gbs * us / 1e3, float(pct.group(1))))
    return rows


def main() -> None:
    path, skip = sys.argv[1], sys.argv[3:] if sys.argv[2:3] == ["--skip"] else []
    sums: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for name, us, mb, pct in kernels(open(path).read()):
        if any(word in name for word in skip):
            continue
        row = sums[name]
        row[0] += 1
        row[1] += us
        row[2] += mb
        row[3] = max(row[3], pct)
    print("| kernel | launches | us | DRAM MB | TB/s | DRAM % of peak (max) |")
    print("|---|---|---|---|---|---|")
    for name, (n, us, mb, pct) in sorted(sums.items(), key=lambda kv: -kv[1][1]):
        print(f"| `{name[:60]}` | {n} | {us:.1f} | {mb:.0f} | {mb / us:.2f} | {pct:.1f} |")
    us = sum(r[1] for r in sums.values())
    mb = sum(r[2] for r in sums.values())
    print(f"| total | {sum(r[0] for r in sums.values())} | {us:.1f} | {mb:.0f} | {mb / us:.2f} | |")


if __name__ == "__main__":
    main()
