"""The quality benchmark's corpus: pack C++ source trees here, build the dataset on the GPU
machine (which cannot download).

    # here: curate the trees of benchmarks/quality_corpus.toml, drop HumanEval-X look-alikes,
    # train the tokenizer, write one .tar.xz per tree + tokenizer.json + corpus_manifest.json
    PYTHONPATH=src python benchmarks/quality_corpus.py pack --mirror /work/.mirror \\
        --out .device-carry/quality

    # there: unpack (in parallel) and run `megacpp data build` on many cores
    PYTHONPATH=src python benchmarks/quality_corpus.py build --carry .device-carry/quality \\
        --out data/quality --workers 60

``pack`` runs megacpp's own curation (the filters, licence policy and exact + near dedup of
the shipped data config ``quality``'s ``[corpus]``, validation trees first) so only documents the
build would keep travel, then removes documents that contain a HumanEval-X C++ function
signature (eval data must never be trained on; the count is recorded). ``build`` curates
again (the same result: the step is deterministic), splits validation by tree
(``packing.val_sources``), and writes ``build_report.json`` beside the dataset: wall time per
stage, cores, tokens per split. Extra trees found only on the GPU machine (``--extra
NAME=PATH``, e.g. torch's C++ headers) train too and are recorded with their file list's hash.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from megacpp.errors import MegaCppError

SOURCES = ROOT / "benchmarks" / "quality_corpus.toml"
BUILD_CONFIG = ROOT / "src" / "megacpp" / "configs" / "data" / "quality.toml"
MANIFEST = "corpus_manifest.json"
TOKENIZER = "tokenizer.json"  # carried as tokenizer.json.xz


# ---- sources -------------------------------------------------------------------------------


def read_trees(path: Path) -> list[dict[str, Any]]:
    trees = tomllib.loads(path.read_text())["tree"]
    names = [t["name"] for t in trees]
    if len(set(names)) != len(names):
        raise MegaCppError(f"{path}: tree names must be unique")
    for tree in trees:
        if ("github" in tree) == ("debian" in tree):
            raise MegaCppError(f"{path}: tree {tree['name']!r} needs exactly one of github, debian")
        tree.setdefault("role", "train")
    return trees


def resolve_tree(tree: dict[str, Any], mirror: Path, scratch: Path) -> tuple[Path, dict]:
    """The tree's directory and its provenance (package version or commit)."""
    if "debian" in tree:
        path = Path(tree["path"])
        version = subprocess.run(["dpkg-query", "-W", "-f=${Version}", tree["debian"]],
                                 capture_output=True, text=True, check=False).stdout.strip()
        if not path.is_dir() or not version:
            raise MegaCppError(f"tree {tree['name']}: install {tree['debian']} "
                               f"(apt-get install {tree['debian']}); {path} is missing")
        return path, {"debian": tree["debian"], "version": version, "path": str(path)}
    git_dir = mirror / tree["github"].replace("/", "+") / "repo"
    if not git_dir.is_dir():
        raise MegaCppError(f"tree {tree['name']}: no snapshot of {tree['github']} at {git_dir} "
                           "(bring it with the search tool's fetch)")
    commit = subprocess.run(["git", "--git-dir", str(git_dir), "rev-parse", "HEAD"],
                            capture_output=True, text=True, check=True).stdout.strip()
    dest = scratch / tree["name"]
    missing = export_sources(git_dir, dest)
    return dest, {"github": tree["github"], "commit": commit, "blobs_not_in_snapshot": missing}


def export_sources(git_dir: Path, dest: Path) -> int:
    """Write HEAD's C/C++ files (by extension, at most 1 MiB: what curation would read) under
    ``dest``; returns how many such blobs the snapshot lacks (snapshots leave out big files)."""
    from megacpp.data.config import CorpusConfig

    cfg = CorpusConfig()
    listing = subprocess.run(["git", "--git-dir", str(git_dir), "ls-tree", "-r", "-l", "-z",
                              "HEAD"], capture_output=True, check=True).stdout.split(b"\0")
    wanted, missing = [], 0
    for entry in listing:
        if not entry:
            continue
        meta, _, path = entry.partition(b"\t")
        mode, kind, sha, size = meta.split()
        name = path.decode("utf-8", "replace")
        if kind != b"blob" or mode == b"120000" or Path(name).suffix.lower() not in cfg.extensions:
            continue
        if not size.isdigit():  # "BAD": the snapshot lacks the blob
            missing += 1
        elif int(size) <= cfg.max_bytes:
            wanted.append((sha.decode(), name))
    batch = subprocess.run(["git", "--git-dir", str(git_dir), "cat-file", "--batch"],
                           input="".join(f"{sha}\n" for sha, _ in wanted).encode(),
                           capture_output=True, check=True).stdout
    stream = io.BytesIO(batch)
    for _sha, name in wanted:
        header = stream.readline().split()
        if header[-1] == b"missing":
            missing += 1
            continue
        data = stream.read(int(header[2]))
        stream.read(1)  # the newline after each object
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return missing


# ---- decontamination -----------------------------------------------------------------------


def humaneval_signatures(problems_path: Path | None) -> dict[str, str]:
    """HumanEval-X C++ function name -> its signature with all whitespace removed (the line
    of the prompt that declares the function to complete)."""
    from megacpp.eval import load_problems

    signatures = {}
    for problem in load_problems(problems_path):
        declaration = problem.declaration.strip().splitlines()[-1]
        match = re.search(r"([A-Za-z_]\w*)\s*\(", declaration)
        if match:
            signatures[match.group(1)] = re.sub(r"\s+", "", declaration).rstrip("{")
    return signatures


def contaminated(text: str, names_re: re.Pattern, signatures: dict[str, str]) -> str | None:
    """The HumanEval-X function whose signature ``text`` contains, if any."""
    for name in set(names_re.findall(text)):
        if signatures[name] in re.sub(r"\s+", "", text):
            return name
    return None


# ---- pack ----------------------------------------------------------------------------------


def pack(args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.progress import Progress

    from megacpp.data.build import (
        BuildConfig,
        curate_documents,
        plan_documents,
        validation_roots,
    )
    from megacpp.data.build import _count_cross_split as count_cross_split
    from megacpp.data.curate import curation_steps
    from megacpp.data.tokenizer import CppTokenizer, iter_capped, train_tokenizer

    started = time.monotonic()
    cfg = BuildConfig.from_toml(args.config)
    trees = read_trees(args.sources)
    if args.only:
        trees = [t for t in trees if t["name"] in set(args.only)]
    if args.out.is_dir() and any(args.out.iterdir()):
        if not (args.out / MANIFEST).is_file():
            raise MegaCppError(f"{args.out} is not empty and holds no {MANIFEST}: choose an "
                               "empty --out (an earlier pack's folder is replaced)")
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="quality-corpus-", dir=args.scratch))
    try:
        roots, provenance = [], {}
        for tree in trees:
            path, prov = resolve_tree(tree, args.mirror, scratch)
            # each tree is walked under a directory of its own name (the split is by that name)
            link = scratch / "roots" / tree["name"]
            link.parent.mkdir(exist_ok=True)
            if not link.exists():
                link.symlink_to(path.resolve(), target_is_directory=True)
            roots.append(link)
            provenance[tree["name"]] = prov
        val_names = [t["name"] for t in trees if t["role"] == "validation"]
        if sorted(val_names) != sorted(cfg.packing.val_sources):
            raise MegaCppError(f"{args.config}: packing.val_sources {cfg.packing.val_sources} "
                               f"differ from the validation trees of {args.sources}: {val_names}")
        val_roots = validation_roots(roots, val_names)
        ordered = [*val_roots, *[r for r in roots if r.name not in val_names]]
        console = Console(stderr=True)
        steps = curation_steps(cfg.corpus)
        with Progress(console=console, transient=True) as progress:
            docs, stages = curate_documents(ordered, cfg.corpus, progress, None, steps)
        curated_s = time.monotonic() - started
        console.print(f"curated {len(docs)} documents in {curated_s:.0f} s")

        signatures = humaneval_signatures(args.problems)
        from megacpp.eval import locate_problems

        problems_file = locate_problems(args.problems)  # carried too: sampling needs it there
        shutil.copyfile(problems_file, args.out / problems_file.name)
        names_re = re.compile(r"\b(" + "|".join(map(re.escape, signatures)) + r")\s*\(")
        kept, dropped = [], {}
        for doc in docs:
            hit = contaminated(doc.text, names_re, signatures)
            if hit is None:
                kept.append(doc)
            else:
                dropped[f"{Path(doc.source_root).name}/{doc.rel_path}"] = hit
        console.print(f"HumanEval-X decontamination: dropped {len(dropped)} documents")

        planned, split_stats = plan_documents(kept, cfg.packing, val_roots)
        count_cross_split(steps, val_roots, split_stats)
        tokenizer_started = time.monotonic()
        train_texts = iter_capped((p.doc.text for p in planned if p.split == "train"),
                                  cfg.tokenizer.max_train_bytes)
        hf = train_tokenizer(train_texts, cfg.tokenizer.vocab_size,
                             min_frequency=cfg.tokenizer.min_frequency,
                             reserve=cfg.tokenizer.reserve)
        CppTokenizer.from_hf(hf).save(args.out / TOKENIZER)
        tokenizer_sha256 = _sha256(args.out / TOKENIZER)
        with open(args.out / TOKENIZER, "rb") as src, \
                lzma.open(args.out / f"{TOKENIZER}.xz", "wb", preset=9) as dst:
            shutil.copyfileobj(src, dst)
        (args.out / TOKENIZER).unlink()
        tokenizer_s = time.monotonic() - tokenizer_started

        by_tree: dict[str, list] = {t["name"]: [] for t in trees}
        for doc in kept:
            by_tree[Path(doc.source_root).name].append(doc)
        packed_started = time.monotonic()
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            futures = {
                name: pool.submit(write_tarball, args.out / f"{name}.tar.xz", name,
                                  [(d.rel_path, d.text) for d in docs_])
                for name, docs_ in by_tree.items()
            }
            tarballs = {name: future.result() for name, future in futures.items()}
        pack_s = time.monotonic() - packed_started
        manifest = {
            "format": "megacpp-quality-corpus",
            "config": _display(args.config),
            "sources": _display(args.sources),
            "val_sources": val_names,
            "trees": [{"name": t["name"], "role": t["role"], **provenance[t["name"]],
                       "documents": len(by_tree[t["name"]]),
                       "bytes": sum(d.size for d in by_tree[t["name"]]),
                       **tarballs[t["name"]]} for t in trees],
            "curation": [s.to_dict() for s in stages],
            "split": split_stats.to_dict(),
            "humaneval_decontamination": {"dropped": len(dropped), "documents": dropped,
                                          "problems": problems_file.name,
                                          "sha256": _sha256(problems_file)},
            "tokenizer": {"file": f"{TOKENIZER}.xz", "sha256": tokenizer_sha256,
                          "vocab_size": cfg.tokenizer.vocab_size,
                          "trained_on_bytes": cfg.tokenizer.max_train_bytes},
            "timings_s": {"curate": curated_s, "tokenizer": tokenizer_s, "compress": pack_s,
                          "total": time.monotonic() - started},
            "cores": os.cpu_count(),
        }
        total = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file())
        manifest["xz_bytes_total"] = total
        (args.out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        print_pack_summary(manifest)
        if total > args.max_mib * 2**20:
            raise MegaCppError(f"{args.out} holds {total / 2**20:.1f} MiB, over --max-mib "
                               f"{args.max_mib}: drop or shrink trees in {args.sources}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def write_tarball(path: Path, name: str, files: list[tuple[str, str]]) -> dict[str, Any]:
    """One tree's kept files as ``name/rel_path`` in an xz (-9e) tar, files in path order."""
    files = sorted(files)
    tmp = path.with_suffix(".partial")
    with lzma.open(tmp, "wb", preset=9 | lzma.PRESET_EXTREME) as raw, \
            tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel_path, text in files:
            data = text.encode("utf-8", "surrogatepass")
            info = tarfile.TarInfo(f"{name}/{rel_path}")
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, path)
    return {"tarball": path.name, "xz_bytes": path.stat().st_size, "sha256": _sha256(path),
            "files": len(files)}


def print_pack_summary(manifest: dict[str, Any]) -> None:
    print(f"{'tree':<22} {'role':<10} {'docs':>7} {'MB':>8} {'xz MB':>7}")
    for t in manifest["trees"]:
        print(f"{t['name']:<22} {t['role']:<10} {t['documents']:>7} {t['bytes'] / 1e6:>8.1f} "
              f"{t['xz_bytes'] / 1e6:>7.2f}")
    docs = sum(t["documents"] for t in manifest["trees"])
    size = sum(t["bytes"] for t in manifest["trees"])
    print(f"{'total':<33} {docs:>7} {size / 1e6:>8.1f} {manifest['xz_bytes_total'] / 1e6:>7.2f}"
          " (the whole folder, tokenizer and HumanEval-X file included)")
    print(f"HumanEval-X look-alikes dropped: {manifest['humaneval_decontamination']['dropped']}; "
          f"timings {json.dumps({k: round(v, 1) for k, v in manifest['timings_s'].items()})}")


# ---- build ---------------------------------------------------------------------------------


def unpack_one(tarball: Path, dest: Path, sha256: str) -> int:
    if _sha256(tarball) != sha256:
        raise MegaCppError(f"{tarball}: sha256 differs from the corpus manifest (corrupt copy)")
    with tarfile.open(tarball, "r:xz") as tar:
        tar.extractall(dest, filter="data")
        return len(tar.getmembers())


def require_build_modules() -> None:
    """The data build's imports, checked before anything is unpacked."""
    import importlib

    missing = []
    for module in ("datasketch", "tree_sitter", "tree_sitter_cpp", "pyarrow", "tokenizers"):
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise MegaCppError(
            f"the data build needs {', '.join(missing)}: carry .whl (scripts/peer_wheels.sh) and "
            "`python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl` with "
            "/tmp/site on PYTHONPATH")


def build(args: argparse.Namespace) -> None:
    require_build_modules()
    manifest_path = args.carry / MANIFEST
    if not manifest_path.is_file():
        raise MegaCppError(f"{manifest_path} is missing: carry the folder `quality_corpus.py "
                           "pack` wrote (.device-carry/quality)")
    manifest = json.loads(manifest_path.read_text())
    started = time.monotonic()
    src = args.src or args.out.parent / f"{args.out.name}-src"
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    with ProcessPoolExecutor(max_workers=min(len(manifest["trees"]), args.workers)) as pool:
        counts = list(pool.map(unpack_one, [args.carry / t["tarball"] for t in manifest["trees"]],
                               [src] * len(manifest["trees"]),
                               [t["sha256"] for t in manifest["trees"]]))
    unpack_s = time.monotonic() - started
    print(f"unpacked {sum(counts)} files of {len(counts)} trees in {unpack_s:.1f} s", flush=True)
    tokenizer = args.out.parent / f"{args.out.name}_{TOKENIZER}"
    with lzma.open(args.carry / manifest["tokenizer"]["file"]) as packed, \
            open(tokenizer, "wb") as dst:
        shutil.copyfileobj(packed, dst)
    if _sha256(tokenizer) != manifest["tokenizer"]["sha256"]:
        raise MegaCppError(f"{args.carry / manifest['tokenizer']['file']}: the tokenizer's "
                           "sha256 differs from the corpus manifest (corrupt copy)")
    roots = [src / t["name"] for t in manifest["trees"]]
    extras = []
    for item in args.extra:
        name, _, path = item.partition("=")
        if not Path(path).is_dir():
            print(f"extra tree {name}: {path} is not a directory; skipped", flush=True)
            continue
        link = src / name
        link.symlink_to(Path(path).resolve(), target_is_directory=True)
        roots.append(link)
        extras.append({"name": name, "path": str(Path(path).resolve()),
                       "torch_version": _version("torch")})
    command = [sys.executable, "-m", "megacpp", "data", "build", *map(str, roots), "--out",
               str(args.out), "--config", str(args.config), "--tokenizer", str(tokenizer),
               "--workers", str(args.workers), "--overwrite"]
    build_started = time.monotonic()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}
    done = subprocess.run(command, env=env, check=False)
    if done.returncode != 0:
        raise MegaCppError(f"megacpp data build failed (exit {done.returncode})")
    build_s = time.monotonic() - build_started
    data = json.loads((args.out / "manifest.json").read_text())
    report = {
        "corpus_manifest_sha256": _sha256(manifest_path),
        "command": " ".join(command),
        "workers": args.workers, "cores": os.cpu_count(),
        "timings_s": {"unpack": unpack_s, "data_build": build_s,
                      "total": time.monotonic() - started},
        "extra_trees": extras,
        "splits": {s: {k: v[k] for k in ("documents", "tokens", "bytes", "rows")}
                   for s, v in data["splits"].items()},
        "split_notes": next(s["notes"] for s in data["stages"] if s["name"] == "split"),
        "documents_by_root": documents_by_root(args.out),
    }
    (args.out.parent / f"{args.out.name}_build_report.json").write_text(
        json.dumps(report, indent=1) + "\n")
    shutil.copyfile(manifest_path, args.out.parent / f"{args.out.name}_{MANIFEST}")
    train, val = report["splits"]["train"], report["splits"]["validation"]
    print(f"dataset {args.out}: train {train['tokens']:,} tokens ({train['documents']:,} "
          f"documents), validation {val['tokens']:,} tokens ({val['documents']:,} documents); "
          f"unpack {unpack_s:.0f} s + data build {build_s:.0f} s on {args.workers} workers",
          flush=True)


def documents_by_root(data: Path) -> dict[str, dict[str, int]]:
    import pyarrow.parquet as pq

    table = pq.read_table(data / "documents.parquet", columns=["source_root", "size",
                                                                  "num_tokens", "split"])
    out: dict[str, dict[str, int]] = {}
    for root, size, tokens, split in zip(*(table.column(c).to_pylist() for c in table.column_names)):
        entry = out.setdefault(Path(root).name, {"documents": 0, "bytes": 0, "tokens": 0})
        entry["documents"] += 1
        entry["bytes"] += size
        entry["tokens"] += tokens
        entry["split"] = split
    return out


def _display(path: Path) -> str:
    """``path`` relative to the repository when inside it (recorded in manifests)."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="curate, decontaminate and compress the trees; train the "
                       "tokenizer")
    p.add_argument("--sources", type=Path, default=SOURCES)
    p.add_argument("--config", type=Path, default=BUILD_CONFIG)
    p.add_argument("--mirror", type=Path, default=Path("/work/.mirror"),
                   help="folder of OWNER+NAME/repo snapshot git directories")
    p.add_argument("--out", type=Path, default=ROOT / ".device-carry" / "quality")
    p.add_argument("--scratch", type=Path, default=None, help="where repositories are exported")
    p.add_argument("--problems", type=Path, default=None, help="HumanEval-X C++ (to exclude)")
    p.add_argument("--only", nargs="+", default=None, help="only these trees (a slice)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--max-mib", type=float, default=40.0,
                   help="refuse a bigger --out folder (it travels to the GPU machine)")
    b = sub.add_parser("build", help="unpack and run `megacpp data build`")
    b.add_argument("--carry", type=Path, default=ROOT / ".device-carry" / "quality")
    b.add_argument("--out", type=Path, default=ROOT / "data" / "quality")
    b.add_argument("--src", type=Path, default=None, help="where the trees are unpacked")
    b.add_argument("--config", type=Path, default=BUILD_CONFIG)
    b.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    b.add_argument("--extra", action="append", default=[], metavar="NAME=PATH",
                   help="another train tree found on this machine (recorded)")
    args = ap.parse_args(argv)
    for key in ("sources", "config"):
        if hasattr(args, key):
            setattr(args, key, getattr(args, key).resolve())
    (pack if args.command == "pack" else build)(args)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except MegaCppError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
