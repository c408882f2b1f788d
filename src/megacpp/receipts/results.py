"""Where benchmark results live: ``benchmarks/results/<benchmark>/<device>/``.

Each benchmark keeps one current result per device: its JSON, its receipts, its PNG and the
exact command that produced them. A rerun replaces them (git keeps the history). A run has a
*stem* (the benchmark's name unless it runs a named part, e.g. the kernels bench's Mamba-3
cases): its files are ``<stem>.json``, ``<stem>.png``, ``receipts/<stem>/...`` and the command
is ``command.txt`` (or ``<stem>.command.txt`` for a named part). Starting a run removes that
stem's previous files and nothing else.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from pathlib import Path

from megacpp._io import atomic_write_text

RESULTS_ROOT = Path("benchmarks") / "results"

# marketing names -> short slugs (the first that matches wins)
_DEVICE_SLUGS = (
    (r"\bH200\b", "h200"),
    (r"\bH100\b", "h100"),
    (r"\bH20\b", "h20"),
    (r"\bGH200\b", "gh200"),
    (r"\bB200\b", "b200"),
    (r"\bA100\b", "a100"),
    (r"\bL40S\b", "l40s"),
    (r"\bL4\b", "l4"),
    (r"\bA10G?\b", "a10"),
    (r"\bRTX ?(\d{4})\b", r"rtx\1"),
)


def device_slug(device_name: str | None = None, count: int = 1) -> str:
    """``"h100"`` for "NVIDIA H100 80GB HBM3", ``"h100x4"`` for four of them, ``"cpu"`` for
    None. Without a name, the current CUDA device's (or ``"cpu"`` where there is none)."""
    if device_name is None:
        import torch

        if not torch.cuda.is_available():
            return "cpu"
        device_name = torch.cuda.get_device_name()
    for pattern, slug in _DEVICE_SLUGS:
        match = re.search(pattern, device_name, flags=re.IGNORECASE)
        if match:
            base = match.expand(slug).lower()
            break
    else:
        base = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "gpu"
    return base if count <= 1 else f"{base}x{count}"


def results_dir(benchmark: str, device: str | None = None, root: Path | None = None) -> Path:
    """``<root>/<benchmark>/<device>`` (root: ``benchmarks/results`` under the current dir)."""
    return (root or RESULTS_ROOT) / benchmark / (device or device_slug())


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed, with the interpreter written as ``python``."""
    argv = list(sys.argv if argv is None else argv)
    script = argv[0]
    if script.endswith(".py"):
        script = os.path.relpath(script) if os.path.isabs(script) else script
        head = ["python", script]
    else:  # python -m ...
        head = ["python", "-m", Path(script).parent.name if script.endswith("__main__.py")
                else script]
    env = "PYTHONPATH=src " if Path("src/megacpp").is_dir() else ""
    return env + shlex.join(head + argv[1:])


def begin(out_dir: Path, stem: str, benchmark: str, argv: list[str] | None = None) -> Path:
    """Make ``out_dir``, drop the previous files of ``stem`` there and write its command."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob(f"{stem}.*"):
        if old.is_file():
            old.unlink()
    shutil.rmtree(out_dir / "receipts" / stem, ignore_errors=True)
    name = "command.txt" if stem == benchmark else f"{stem}.command.txt"
    atomic_write_text(out_dir / name, command_line(argv) + "\n")
    return out_dir
