"""The product tells the present, git tells the past: README, docs, code, tests and benchmark
scripts carry no work-history markers (work-period numbers, commit hashes cited as a point in
time, references to a tracker item) and link no benchmark result that does not exist."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

_HEX = r"(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,12}\b"  # a short hash: digits and letters
MARKERS = {
    "work-period number": re.compile(r"\bsessions?\s+\d+\b", re.IGNORECASE),
    "work call number": re.compile(r"\bcalls?\s+#?\d+\b(?!\s+times\b)", re.IGNORECASE),
    "work-period tag": re.compile(r"\(s\d{1,3}\)|[A-Za-z0-9]_s\d{1,3}\b|(?<![\w./-])s\d{2,3}\b"),
    "a tracker item": re.compile(r"\bthe\s+issue(?:'s|\b)", re.IGNORECASE),
    "commit hash as a time": re.compile(
        rf"\b(?:commits?|at|since|until|before|after)\s+`?{_HEX}|\(\s*`?{_HEX}", re.IGNORECASE),
    "'until <date>'": re.compile(
        r"\buntil\s+(?:\d{4}-\d\d-\d\d|(?:jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)"
        r"[a-z]*\.?\s+(?:\d{1,2},?\s+)?\d{4})", re.IGNORECASE),
}
RESULT_PATH = re.compile(r"benchmarks/results/[A-Za-z0-9_.*/-]*")


def _files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "benchmarks").glob("*.py"))]
    for pattern in ("*.py", "*.toml", "*.md"):
        files += [p for p in sorted((ROOT / "src").rglob(pattern))
                  if not any(part.endswith(".egg-info") for part in p.parts)]
    files += [p for p in sorted((ROOT / "tests").rglob("*.py")) if p != Path(__file__).resolve()]
    return [p for p in files if p.is_file()]


def history_markers(text: str) -> list[tuple[str, str]]:
    """(what, the matched text) for every work-history marker in ``text``."""
    return [(what, m.group(0)) for what, rx in MARKERS.items() for m in rx.finditer(text)]


def missing_result_paths(text: str) -> list[str]:
    """The ``benchmarks/results/...`` paths in ``text`` that do not exist. A path that goes on
    with a placeholder (``benchmarks/results/kernels/<device>``) names where a benchmark
    writes, not a result, and is not checked."""
    missing = []
    for m in RESULT_PATH.finditer(text):
        if text[m.end():m.end() + 1] in ("<", "{"):
            continue
        path = m.group(0).rstrip(".")
        if "*" in path:
            path = path[:path.index("*")].rsplit("/", 1)[0]
        if not (ROOT / path).exists():
            missing.append(path)
    return missing


# The samples of what the markers must catch are built from their parts, so that this file
# itself holds no line of the kind it looks for.
_PERIOD, _CALL, _ITEM = "session", "call", "issue"
_SHORT = [hashlib.sha1(seed).hexdigest()[:7] for seed in (b"a", b"b")]
_OLD_RESULT = "benchmarks/results/" + "train_h100_s" + "26"
HISTORY_SAMPLES = [
    f"On an H100 it went from 15.6 to 12.8 ms ({_PERIOD} 30).",
    f"{_PERIOD.capitalize()}s 28 measured the GPU idle",
    f"the log of {_CALL} 4", f"see {_CALL} 2's output", "(s" + "31)", _OLD_RESULT,
    "at s" + "31 the kernel", f"The {_ITEM}'s goal (>= 5x) is met", f"as the {_ITEM} asks",
    f"eager 42.5k tokens/s ({_SHORT[0]}, before Muon was batched)", f"at commit {_SHORT[0]}",
    f"the JSONs of commits {_SHORT[0]} and {_SHORT[1]}", "until " + "2026-11-22 it did X",
    "until " + "November 2026 the server did X",
]


@pytest.mark.parametrize("text", HISTORY_SAMPLES)
def test_the_markers_catch_work_history(text):
    assert history_markers(text), text


@pytest.mark.parametrize("text", [
    "the hook calls 3 times per step", "fla issue 640 on Triton 3.4", "triton issue #10331",
    "sha256 `a55c279a74a619dc105befeb72f8387347fc476e86b24784517cbc5536e415c1`",
    "commit `000c4ac24f61159c138b0975def722c65245983c`", "git.sha 0686e2e…",
    "until 2048 tokens are in the batch", "a 32s timeout", "torch.float32 casts", "h100x4",
    "RTX 4090's sm_89", "the session cookie", "seq_s128_h4",
])
def test_the_markers_leave_present_tense_text_alone(text):
    assert not history_markers(text), history_markers(text)


def test_missing_result_paths_are_found_and_present_ones_pass():
    assert missing_result_paths(f"[r](../{_OLD_RESULT}/log.txt)") == [f"{_OLD_RESULT}/log.txt"]
    present = sorted(p for p in RESULTS.glob("*/*") if p.is_dir())
    assert present, "benchmarks/results holds no results"
    rel = present[0].relative_to(ROOT).as_posix()
    assert missing_result_paths(f"[results]({rel}). And benchmarks/results/<b>/<d>/") == []
    assert missing_result_paths("default: benchmarks/results/not_run_yet/<device>") == []


def test_the_tree_carries_no_work_history():
    hits = []
    for path in _files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{number}"
            hits += [f"{where}: {what}: {found!r}" for what, found in history_markers(line)]
            hits += [f"{where}: missing result: {p}" for p in missing_result_paths(line)]
    assert not hits, "work history in the product (git keeps the past):\n" + "\n".join(hits)
