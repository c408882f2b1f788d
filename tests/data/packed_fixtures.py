"""Helpers shared by the tokenizer/structure/packing/shards/loader/megatron/build tests:
small real and synthetic C++ corpora, a tiny tokenizer, a tiny build config.

(Imported as ``tests.data.packed_fixtures``: pyproject puts the repo root on pytest's path.)
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

LIBSTDCXX = Path("/usr/include/c++/12")
# Small real headers, with and without an extension.
REAL_HEADERS = (
    "cstddef",
    "utility",
    "initializer_list",
    "bits/move.h",
    "bits/stl_relops.h",
    "bits/ptr_traits.h",
    "bits/stl_pair.h",
    "bits/stl_function.h",
    "bits/invoke.h",
    "bits/std_abs.h",
    "bits/erase_if.h",
    "bits/hash_bytes.h",
)

SYNTHETIC = {
    "src/widget.cpp": """// Widget implementation. Copyright (c) 2024 Example. MIT License.
#include <string>
#include "widget.h"

namespace ui {
template <typename T, int N = 3>
struct Box {
    T items[N];
    int size() const { return N; }
};

/* Render a widget. */
std::string render(const Widget& w, int depth) {
    auto label = [&](int d) { return std::string(d, ' ') + w.name; };
    const char* raw = R"(raw "string" \\n)";
    char c = '\\'';
    return label(depth) + raw + c + "é ✓";
}
}  // namespace ui
""",
    "include/widget.h": """#pragma once
#ifndef WIDGET_H
#define WIDGET_H
#include <string>

class Widget {
 public:
    explicit Widget(std::string name) : name(std::move(name)) {}
    virtual ~Widget() = default;
    virtual int area() const;
    std::string name;
};

#endif  // WIDGET_H
""",
    "src/numbers.cc": """#include <cstdint>
static const std::uint64_t kTable[] = {12345678901234ULL, 0x7fffffff, 3, 14, 159};
int sum(int a, int b) {\r\n\treturn a + b;\r\n}
double pi() { return 3.14159265358979; }
""",
    "src/odd_spacing.cpp": "int   x    =   1 ;\t\t// tabs\t\n\n\n   \n  int y=2;   \n",
    # hostile but valid UTF-8: literal special-token text, form feed, lone CR, deep nesting
    "src/hostile.cpp": (
        'const char* s = "<|eos|> <|bos|> <|pad|>";\f\n#define X(a) a##a\r int z = X(1);\n'
        + "int deep() "
        + "{ " * 200
        + "return 0;"
        + " }" * 200
        + "\n"
    ),
}
# Files curation must drop (binary, not UTF-8, empty): the build keeps going without them.
DROPPED = {
    "src/blob.h": b"\x00\x01\x02binary\x00" * 20,
    "src/latin1.cpp": "// caf\xe9\nint main() { return 0; }\n".encode("latin-1"),
    "src/empty.cc": b"",
}


def require_libstdcxx() -> None:
    if not (LIBSTDCXX / "utility").is_file():
        pytest.skip(f"needs the libstdc++ headers in {LIBSTDCXX} (apt-get install g++)")


def real_texts() -> list[str]:
    """The real headers' texts."""
    require_libstdcxx()
    return [(LIBSTDCXX / rel).read_text(encoding="utf-8") for rel in REAL_HEADERS]


def write_corpus(root: Path, *, real: bool = True) -> Path:
    """A small corpus under ``root``: the synthetic files, files curation drops, plus copies
    of the real headers."""
    files = {rel: text.encode("utf-8") for rel, text in SYNTHETIC.items()} | DROPPED
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    if real:
        require_libstdcxx()
        for rel in REAL_HEADERS:
            path = root / "libstdcxx" / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(LIBSTDCXX / rel, path)
    return root


def tiny_config_dict(
    *,
    vocab_size: int = 512,
    seq_len: int = 64,
    val_permille: int = 250,
    rows_per_shard: int = 16,
    rows_per_group: int = 4,
) -> dict:
    """A build config small enough for tests (several shards and row groups per split)."""
    return {
        "tokenizer": {"vocab_size": vocab_size, "max_train_bytes": 1 << 20},
        "packing": {
            "seq_len": seq_len,
            "seed": 7,
            "val_permille": val_permille,
            "val_sources": [],
            "rows_per_shard": rows_per_shard,
            "rows_per_group": rows_per_group,
        },
    }


def build_tiny(tmp: Path, **config) -> Path:
    """Build a tiny dataset from :func:`write_corpus` in-process; returns its directory."""
    from megacpp.data.build import BuildConfig, build_dataset

    sources = write_corpus(tmp / "src")
    out = tmp / "dataset"
    build_dataset([sources], out, BuildConfig.from_dict(tiny_config_dict(**config)), workers=1)
    return out
