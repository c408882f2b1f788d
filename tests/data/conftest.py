"""Shared fixtures for the corpus pipeline tests: files written on the fly (hostile ones
included), a few real libstdc++ headers, and a generator of synthetic C++ with labelled
near-duplicate variants.

Fixtures:
* ``write_tree(root, {rel_path: str | bytes})`` -> root: writes files (parents created).
* ``hostile_corpus`` -> :class:`HostileCorpus`: a directory with one file per way a source
  tree can go wrong, and the drop reason each one should get.
* ``real_headers`` -> list of real /usr/include/c++/12 header paths (skips if absent).
* ``cpp_source`` -> ``make(seed) -> str``: a synthetic, compilable-looking C++ file.
* ``near_dup_corpus`` -> list of :class:`LabelledDoc`: bases, their edited variants and
  unrelated files, each labelled with a cluster id.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

LIBSTDCXX = Path("/usr/include/c++/12")

GPL_RUNTIME_HEADER = """\
// Copyright (C) 2001-2022 Free Software Foundation, Inc.
//
// This file is part of the GNU ISO C++ Library.  This library is free
// software; you can redistribute it and/or modify it under the
// terms of the GNU General Public License as published by the
// Free Software Foundation; either version 3, or (at your option)
// any later version.

// Under Section 7 of GPL version 3, you are granted additional
// permissions described in the GCC Runtime Library Exception, version
// 3.1, as published by the Free Software Foundation.
"""


def _write(root: Path, files: Mapping[str, str | bytes]) -> Path:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            path.write_text(content, encoding="utf-8")
        else:
            path.write_bytes(content)
    return root


@pytest.fixture
def write_tree() -> Callable[[Path, Mapping[str, str | bytes]], Path]:
    return _write


# --------------------------------------------------------------------------- synthetic C++

_WORDS = (
    "buffer", "node", "count", "index", "value", "size", "item", "parse", "token", "stream",
    "cache", "graph", "edge", "vertex", "key", "queue", "state", "frame", "block", "chunk",
    "offset", "length", "result", "error", "config", "handle", "event", "timer", "socket",
    "path", "name", "table", "row", "column", "matrix", "hash", "seed", "limit", "score",
    "weight", "bias", "layer", "model", "batch", "step", "epoch", "rate", "delta", "alpha",
    "pixel", "color", "image", "scale", "range", "span", "slot", "entry", "record",
)  # fmt: skip
_TYPES = ("int", "long", "double", "bool", "std::size_t", "unsigned", "float")


def _ident(rng: random.Random, used: set[str]) -> str:
    while True:
        a, b = rng.sample(_WORDS, 2)
        name = f"{a}_{b}" if rng.random() < 0.5 else f"{a}{b.capitalize()}"
        if name not in used:
            used.add(name)
            return name


def _statement(rng: random.Random, vars_: list[str], funcs: list[str], depth: int = 0) -> str:
    a, b, c = (rng.choice(vars_) for _ in range(3))
    n = rng.randint(0, 999)
    templates = [
        f"{a} = {b} + {c} * {n};",
        f"{a} += std::max({b}, {c});",
        f"{a} = ({b} - {n}) / ({c} + 1);",
        f"if ({a} > {b}) {{ {c} = {a} - {n}; }}",
        f"{a} = {b} % {n + 1} == 0 ? {c} : {b};",
        f"std::swap({a}, {b});",
        f"{a} ^= {b} << {rng.randint(1, 9)};",
    ]
    if funcs:
        f = rng.choice(funcs)
        templates.append(f"{a} = {f}({b}, {c});")
    if depth == 0:
        inner = _statement(rng, vars_, funcs, depth + 1)
        templates += [
            f"for (int i = 0; i < {n % 17 + 2}; ++i) {{ {inner} }}",
            f"while ({a} < {b}) {{ {inner} ++{a}; }}",
        ]
    return rng.choice(templates)


@dataclass
class SyntheticFile:
    """A generated C++ file kept as parts, so variants can edit it structurally."""

    header: str
    includes: list[str]
    namespace: str
    functions: list[str]
    identifiers: list[str]

    def render(self) -> str:
        body = "\n\n".join(self.functions)
        includes = "\n".join(f"#include <{inc}>" for inc in self.includes)
        namespace = f"namespace {self.namespace} {{\n\n{body}\n\n}}  // namespace\n"
        return f"{self.header}\n{includes}\n\n{namespace}"


def synthetic_file(seed: int, num_functions: int | None = None) -> SyntheticFile:
    rng = random.Random(seed)
    used: set[str] = set()
    funcs: list[str] = []
    texts: list[str] = []
    for _ in range(num_functions or rng.randint(12, 24)):
        name = _ident(rng, used)
        params = [_ident(rng, used) for _ in range(rng.randint(1, 3))]
        locals_ = [_ident(rng, used) for _ in range(rng.randint(1, 3))]
        type_ = rng.choice(_TYPES)
        vars_ = params + locals_
        lines = [f"    {type_} {v} = {rng.randint(0, 99)};" for v in locals_]
        lines += [f"    {_statement(rng, vars_, funcs)}" for _ in range(rng.randint(4, 10))]
        lines.append(f"    return {rng.choice(vars_)};")
        signature = f"{type_} {name}({', '.join(f'{type_} {p}' for p in params)})"
        texts.append(signature + " {\n" + "\n".join(lines) + "\n}")
        funcs.append(name)
    includes = sorted(rng.sample(["vector", "map", "string", "algorithm", "cstdint", "utility",
                                  "memory", "cmath", "array", "numeric"], 4))  # fmt: skip
    header = f"// {rng.choice(_WORDS)}.cpp -- generated for tests (seed {seed})\n"
    return SyntheticFile(header, includes, _ident(rng, used), texts, sorted(used))


def _reformat(text: str, rng: random.Random) -> str:
    """Whitespace-only changes: indentation, brace style, operator spacing."""
    indent = rng.choice(["\t", "  ", "        "])
    text = re.sub(r"(?m)^    ", indent, text)
    text = text.replace(") {\n", ")\n{\n")
    text = re.sub(r" ([-+*/%]?=) ", r"\1", text)
    return re.sub(r"; ", ";\n" + indent, text)


def _rename(file: SyntheticFile, rng: random.Random, count: int) -> str:
    text = file.render()
    for old in rng.sample(file.identifiers, min(count, len(file.identifiers))):
        text = re.sub(rf"\b{re.escape(old)}\b", f"{old}_v2", text)
    return text


def _edit(file: SyntheticFile, rng: random.Random, fraction: float) -> SyntheticFile:
    """Change ``fraction`` of the body lines: new constants, dropped or inserted lines."""
    functions = []
    for func in file.functions:
        lines = func.split("\n")
        for i in range(1, len(lines) - 2):
            if rng.random() < fraction:
                choice = rng.random()
                if choice < 0.4:
                    lines[i] = re.sub(r"\b\d+\b", lambda m: str(int(m.group()) + 7), lines[i])
                elif choice < 0.7:
                    lines[i] = ""
                else:
                    lines[i] += "\n    ++" + rng.choice(file.identifiers) + ";"
        functions.append("\n".join(line for line in lines if line))
    return SyntheticFile(file.header, file.includes, file.namespace, functions, file.identifiers)


def _comment(text: str, rng: random.Random) -> str:
    lines = text.split("\n")
    out = ["/* Copyright (c) 2024 Someone Else. All rights reserved. */"]
    for line in lines:
        out.append(line)
        if rng.random() < 0.15:
            out.append(f"// note: {rng.choice(_WORDS)} {rng.choice(_WORDS)} handled here")
    return "\n".join(out)


def _reorder(file: SyntheticFile, rng: random.Random) -> SyntheticFile:
    functions = file.functions[:]
    rng.shuffle(functions)
    return SyntheticFile(file.header, file.includes, file.namespace, functions, file.identifiers)


# Near-duplicates of a file, by kind of edit. Token Jaccard (5-token shingles) vs the base,
# mean over 30 bases: reformat/comment 1.0, reorder 0.96, edit 0.91, rename 0.92,
# combined ~0.9, heavy_edit 0.84, heavy_rename 0.85 (the last two straddle threshold 0.8).
VARIANTS: dict[str, Callable[[SyntheticFile, random.Random], str]] = {
    "reformat": lambda f, rng: _reformat(f.render(), rng),
    "comment": lambda f, rng: _comment(f.render(), rng),
    "reorder": lambda f, rng: _reorder(f, rng).render(),
    "edit": lambda f, rng: _edit(f, rng, fraction=0.10).render(),
    "rename": lambda f, rng: _rename(f, rng, count=3),
    "combined": lambda f, rng: _reformat(
        _comment(_rename(_reorder(_edit(f, rng, fraction=0.05), rng), rng, count=2), rng), rng
    ),
    "heavy_edit": lambda f, rng: _edit(f, rng, fraction=0.20).render(),
    "heavy_rename": lambda f, rng: _rename(f, rng, count=6),
}
# Different files of the same project sharing this fraction of the base's functions
# (token Jaccard ~0.33 and ~0.51): hard negatives.
SIBLINGS = {"sibling": 0.5, "close_sibling": 0.7}


def make_variant(file: SyntheticFile, kind: str, seed: int) -> str:
    """A near-duplicate of ``file`` produced by one kind of edit (see VARIANTS)."""
    if kind not in VARIANTS:
        raise ValueError(f"unknown variant kind {kind!r}; known: {', '.join(VARIANTS)}")
    return VARIANTS[kind](file, random.Random(seed))


def make_sibling(file: SyntheticFile, seed: int, shared: float) -> str:
    """A *different* file from the same project: same includes and namespace, ``shared`` of
    the functions copied, the rest new."""
    other = synthetic_file(seed, num_functions=len(file.functions))
    keep = int(len(file.functions) * shared)
    functions = file.functions[:keep] + other.functions[keep:]
    return SyntheticFile(file.header, file.includes, file.namespace, functions,
                         file.identifiers).render()  # fmt: skip


@dataclass
class LabelledDoc:
    name: str
    text: str
    cluster: int  # docs sharing a cluster id are near-duplicates of each other
    kind: str  # "base", "distinct", a SIBLINGS kind or a VARIANTS kind


def near_dup_corpus(
    num_bases: int = 30, num_distinct: int = 30, seed: int = 0
) -> list[LabelledDoc]:
    """Per base: the base and one variant of each VARIANTS kind (one cluster), and one file
    of each SIBLINGS kind (own clusters); plus ``num_distinct`` unrelated files, in a seeded
    shuffled order."""
    docs: list[LabelledDoc] = []
    next_cluster = num_bases
    for b in range(num_bases):
        base = synthetic_file(seed * 100_003 + b)
        docs.append(LabelledDoc(f"base{b}.cpp", base.render(), b, "base"))
        for k, kind in enumerate(VARIANTS):
            variant = make_variant(base, kind, seed * 7919 + 31 * b + k)
            docs.append(LabelledDoc(f"base{b}_{kind}.cpp", variant, b, kind))
        for k, (kind, shared) in enumerate(SIBLINGS.items()):
            sibling = make_sibling(base, seed * 100_003 + 70_000 + 2 * b + k, shared)
            docs.append(LabelledDoc(f"base{b}_{kind}.cpp", sibling, next_cluster, kind))
            next_cluster += 1
    for d in range(num_distinct):
        text = synthetic_file(seed * 100_003 + 50_000 + d).render()
        docs.append(LabelledDoc(f"distinct{d}.cpp", text, next_cluster, "distinct"))
        next_cluster += 1
    random.Random(seed).shuffle(docs)
    return docs


@pytest.fixture
def cpp_source() -> Callable[[int], str]:
    return lambda seed: synthetic_file(seed).render()


@pytest.fixture(name="near_dup_corpus")
def near_dup_corpus_fixture() -> list[LabelledDoc]:
    return near_dup_corpus()


# --------------------------------------------------------------------------- real headers

REAL_HEADER_NAMES = ("vector", "map", "algorithm", "bits/stl_vector.h", "bits/stl_map.h",
                     "bits/stl_algo.h", "optional", "barrier")  # fmt: skip


@pytest.fixture
def real_headers() -> list[Path]:
    paths = [LIBSTDCXX / name for name in REAL_HEADER_NAMES]
    if not all(p.is_file() for p in paths):
        pytest.skip(f"libstdc++ 12 headers not installed under {LIBSTDCXX}")
    return paths


# --------------------------------------------------------------------------- hostile tree


@dataclass
class HostileCorpus:
    """A source tree where every entry has an expected fate."""

    root: Path
    kept: set[str] = field(default_factory=set)  # rel paths that survive curation
    source_skips: dict[str, int] = field(default_factory=dict)  # sources-stage reason -> count
    drops: dict[str, str] = field(default_factory=dict)  # rel path -> later-stage drop reason


def _good_cpp(seed: int) -> str:
    return GPL_RUNTIME_HEADER + synthetic_file(seed, num_functions=6).render()


@pytest.fixture
def hostile_corpus(tmp_path: Path) -> HostileCorpus:
    """Built for ``CorpusConfig(max_bytes=64 * 1024)`` (the huge file must exceed it)."""
    root = tmp_path / "src"
    corpus = HostileCorpus(root)
    good = {f"lib/good{i}.cpp": _good_cpp(i) for i in range(3)}  # walked before vendor/
    _write(root, good)
    corpus.kept |= set(good)
    extensionless = (
        "// <widget> -*- C++ -*-\n#ifndef WIDGET\n#define WIDGET\n" + _good_cpp(9) + "#endif\n"
    )
    bom = "\ufeff" + _good_cpp(10)
    _write(root, {
        "include/widget": extensionless,         # extensionless header, sniffed
        "lib/bom.hpp": bom.encode("utf-8"),       # kept, BOM stripped
        "lib/UPPER.CPP": _good_cpp(11),           # extension matched case-insensitively
        "README": "# widget\nA library.\n",       # extensionless, not C++ -> not_source
        "notes.txt": "text",                      # not_source
        ".git/objects/x.cpp": _good_cpp(12),      # excluded_dir
    })  # fmt: skip
    corpus.kept |= {"include/widget", "lib/bom.hpp", "lib/UPPER.CPP"}
    corpus.drops.update({
        "bad/binary.cpp": "binary",
        "bad/latin1.cpp": "non_utf8",
        "bad/empty.cpp": "too_small",
        "bad/blank.cpp": "blank",
        "bad/minified.js.cpp": "minified",
        "bad/generated.pb.cc": "generated_marker",
        "bad/art.cpp": "low_alnum",
        "bad/secret.cpp": "license_denied",
        "vendor/exact_copy.cpp": "exact_duplicate",
        "vendor/near_copy.cpp": "near_duplicate",
    })  # fmt: skip
    minified = "int f(){return 1;}" * 200 + "\n"
    _write(root, {
        "bad/binary.cpp": b"int main() { return 0; }\n\0\0\x01\x02" * 4,
        "bad/latin1.cpp": ("// caf\xe9 " * 8 + "\nint x = 1;\n").encode("latin-1"),
        "bad/empty.cpp": b"",
        "bad/blank.cpp": " \n\t\n" * 20,
        "bad/minified.js.cpp": minified,
        "bad/generated.pb.cc": "// Generated by the protocol buffer compiler.  DO NOT EDIT!\n"
        + _good_cpp(13),
        "bad/art.cpp": "/*\n" + ("-=*#|" * 12 + "\n") * 30 + "*/\n",
        "bad/secret.cpp": "// Copyright Acme. Proprietary and confidential.\n"
        + synthetic_file(14, num_functions=6).render(),
        "vendor/exact_copy.cpp": good["lib/good0.cpp"].replace("\n", "\n\n"),  # whitespace only
        # good1 with its functions reordered
        "vendor/near_copy.cpp": GPL_RUNTIME_HEADER
        + make_variant(synthetic_file(1, num_functions=6), "reorder", 5),
        "huge.cpp": "int x;\n" * (64 * 1024 // 7 + 100),
    })  # fmt: skip
    corpus.source_skips["too_large"] = 1
    os.symlink("loop_b", root / "loop_a")
    os.symlink("loop_a", root / "loop_b")
    os.symlink("missing.cpp", root / "dangling.cpp")
    os.symlink(".", root / "lib" / "self")  # directory loop when following links
    os.mkfifo(root / "pipe.cpp")
    corpus.source_skips.update({
        "not_source": 2, "excluded_dir": 1, "symlink_skipped": 4, "special_file": 1,
    })  # fmt: skip
    return corpus
