"""Structure ids in training against decoding: how often a token's id differs.

    PYTHONPATH=src python benchmarks/structure_skew.py --sources /usr/include/c++/12

The data build labels every token with the tree-sitter region its last byte sits in, from a
parse of the **whole document** (``megacpp.data.structure``). Decoding cannot see the rest
of the document: the engine labels each generated token from a parse of the **sequence so
far** (``StructureIds.label_last``). Where the two differ, a structure-id model is trained
on ids it will not get when it generates, and its validation loss (which reads the build's
ids) sees ids that depend on text after the token.

For ``--files`` documents drawn from ``--sources`` (``*.h``, ``*.hpp``, ``*.cc``, ``*.cpp``,
in a ``--seed`` order), this tokenizes each, labels it as the build does, then labels
``--positions`` consecutive tokens from a third of the way in as decoding does (one parse
of the prefix per token), and counts the tokens whose two ids differ, overall and per
(build id, decoding id) pair. The tokenizer is ``--tokenizer`` or, without one, a
4,096-token megacpp tokenizer trained on the sampled documents (the token boundaries only
move where a token's last byte falls). Writes ``structure_skew.json``, a ``bench`` receipt
and ``command.txt`` to ``--out`` (default ``benchmarks/results/structure_skew/cpu``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from megacpp.data.structure import Structure
from megacpp.data.tokenizer import CppTokenizer, train_tokenizer
from megacpp.infer.structure import StructureIds

SUFFIXES = (".h", ".hpp", ".cc", ".cpp")


def build_and_decode_ids(labeler: StructureIds, ids: list[int], start: int,
                         count: int) -> list[tuple[int, int]]:
    """(build id, decoding id) of tokens ``start .. start + count - 1`` of ``ids``: the first
    from one parse of the whole sequence, the second from a parse of the prefix that ends
    with the token."""
    whole = labeler.label(ids)
    end = min(len(ids), start + count)
    return [(whole[t], labeler.label_last(ids[: t + 1])) for t in range(start, end)]


def sample_files(sources: list[Path], files: int, seed: int, min_bytes: int = 2000) -> list[Path]:
    found = sorted(p for src in sources for p in (src.rglob("*") if src.is_dir() else [src])
                   if p.is_file() and p.suffix in SUFFIXES and p.stat().st_size >= min_bytes)
    random.Random(seed).shuffle(found)
    return found[:files]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sources", type=Path, nargs="+", default=[Path("/usr/include/c++/12")])
    ap.add_argument("--files", type=int, default=40)
    ap.add_argument("--positions", type=int, default=300, help="tokens labelled per file")
    ap.add_argument("--tokenizer", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.files < 1 or args.positions < 1:
        ap.error("--files and --positions must be >= 1")
    missing = [str(s) for s in args.sources if not s.exists()]
    if missing:
        ap.error(f"--sources: no such path: {', '.join(missing)}")
    from megacpp.receipts import write_receipt
    from megacpp.receipts.results import begin, results_dir

    paths = sample_files(args.sources, args.files, args.seed)
    if not paths:
        ap.error("--sources hold no C++ file of at least 2,000 bytes")
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in paths]
    tok = (CppTokenizer.load(args.tokenizer) if args.tokenizer
           else CppTokenizer.from_hf(train_tokenizer(texts, vocab_size=4096)))
    labeler = StructureIds(tok)
    out = begin(args.out or results_dir("structure_skew", "cpu"), "structure_skew",
                "structure_skew")
    started = time.perf_counter()
    pairs: Counter[tuple[int, int]] = Counter()
    per_file = []
    for path, text in zip(paths, texts, strict=True):
        ids = [int(i) for i in tok.encode(text)]
        got = build_and_decode_ids(labeler, ids, len(ids) // 3, args.positions)
        pairs.update(got)
        differ = sum(b != d for b, d in got)
        per_file.append({"file": str(path), "tokens": len(got), "differ": differ})
        print(f"{path}: {differ}/{len(got)} differ", flush=True)
    total = sum(pairs.values())
    differ = sum(n for (b, d), n in pairs.items() if b != d)
    decode_other = sum(n for (_, d), n in pairs.items() if d == Structure.OTHER)
    build_other = sum(n for (b, _), n in pairs.items() if b == Structure.OTHER)
    result = {
        "benchmark": "structure_skew",
        "sources": [str(s) for s in args.sources], "files": len(paths),
        "positions_per_file": args.positions, "tokenizer": str(args.tokenizer or "trained"),
        "vocab_size": tok.vocab_size, "tokens": total, "differ": differ,
        "differ_rate": differ / total,
        "build_other_rate": build_other / total, "decode_other_rate": decode_other / total,
        "pairs": [{"build": Structure(b).name, "decode": Structure(d).name, "tokens": n}
                  for (b, d), n in pairs.most_common()],
        "per_file": per_file, "wall_s": time.perf_counter() - started,
    }
    (out / "structure_skew.json").write_text(json.dumps(result, indent=2) + "\n")
    write_receipt(out / "receipts" / "structure_skew" / "structure_skew.json", "bench",
                  {k: result[k] for k in ("sources", "files", "positions_per_file",
                                          "tokenizer", "vocab_size")},
                  {"differ_rate": result["differ_rate"],
                   "build_other_rate": result["build_other_rate"],
                   "decode_other_rate": result["decode_other_rate"],
                   "tokens": float(total)})
    print(f"{differ}/{total} tokens ({differ / total:.1%}) get a different id when decoding; "
          f"OTHER: {build_other / total:.1%} of build ids, {decode_other / total:.1%} of "
          f"decoding ids")
    for row in result["pairs"][:8]:
        print(f"  build {row['build']:<20} decode {row['decode']:<20} {row['tokens']}")
    print(f"results: {out / 'structure_skew.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
