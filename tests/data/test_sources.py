"""Walking source roots: selection, provenance, determinism, and every way a tree can be
hostile (each skip reason is produced by a real filesystem condition)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megacpp.data.config import CorpusConfig
from megacpp.data.pipeline import StageStats
from megacpp.data.sources import iter_sources, looks_like_cpp_header
from megacpp.errors import MegaCppError

LIBSTDCXX = Path("/usr/include/c++/12")


def walk(roots, cfg: CorpusConfig | None = None):
    stats = StageStats("sources")
    docs = list(iter_sources([Path(r) for r in roots], cfg or CorpusConfig(), stats))
    return docs, stats


def test_sorted_walk_with_provenance(tmp_path, write_tree):
    write_tree(
        tmp_path, {"b/z.cpp": "int z;", "b/a.h": "int a;", "a.cc": "int c;", "c/d/e.hpp": "int e;"}
    )
    docs, stats = walk([tmp_path])
    assert [d.rel_path for d in docs] == ["a.cc", "b/a.h", "b/z.cpp", "c/d/e.hpp"]
    for doc in docs:
        raw = (tmp_path / doc.rel_path).read_bytes()
        assert doc.source_root == str(tmp_path.resolve()) and os.path.isabs(doc.source_root)
        assert (doc.raw, doc.size, doc.sha256) == (raw, len(raw), hashlib.sha256(raw).hexdigest())
    assert (stats.seen, stats.kept, stats.bytes_out) == (4, 4, sum(d.size for d in docs))
    assert [d.rel_path for d in walk([tmp_path])[0]] == [d.rel_path for d in docs]  # stable


def test_extension_selection(tmp_path, write_tree):
    sources = ["x.c", "x.cc", "x.cpp", "x.cxx", "x.c++", "x.h", "x.hh", "x.hpp", "x.hxx",
               "x.inl", "x.ipp", "x.tcc", "X.CPP"]  # fmt: skip
    names = [*sources, "x.py", "x.txt", "x.cpp.orig", ".hidden"]
    write_tree(tmp_path, {n: "int x;" for n in names})
    docs, stats = walk([tmp_path])
    assert sorted(d.rel_path for d in docs) == sorted(sources)
    assert stats.dropped == {"not_source": 4}
    docs, _ = walk([tmp_path], CorpusConfig(extensions=(".py",)))
    assert [d.rel_path for d in docs] == ["x.py"]


def test_extensionless_headers_detected_by_content(tmp_path, write_tree):
    write_tree(tmp_path, {
        "mode_line": "// <widget> -*- C++ -*-\nint w;\n",
        "pragma_once": "#pragma once\nint p;\n",
        "guarded": "// c\n#ifndef GUARD_H\n#define GUARD_H\n#endif\n",
        "includer": "#include <vector>\n",
        "README": "Widget\n======\nA library.\n",
        "Makefile": "all:\n\tg++ -o w w.cpp\n",
        "script": "#!/bin/sh\n#include <not really>\n",
        "blob": b"#pragma once\0\1\2",
    })  # fmt: skip
    docs, stats = walk([tmp_path])
    assert [d.rel_path for d in docs] == ["guarded", "includer", "mode_line", "pragma_once"]
    assert stats.dropped == {"not_source": 4}
    docs, stats = walk([tmp_path], CorpusConfig(detect_extensionless_headers=False))
    assert docs == [] and stats.dropped == {"not_source": 8}


def test_every_extensionless_libstdcxx_header_is_detected():
    if not LIBSTDCXX.is_dir():
        pytest.skip("libstdc++ 12 headers not installed")
    extensionless = [p for p in LIBSTDCXX.rglob("*") if p.is_file() and "." not in p.name]
    assert len(extensionless) > 150  # vector, map, ext/algorithm, tr1/array, debug/set ...
    missed = [p.name for p in extensionless if not looks_like_cpp_header(p.read_bytes()[:1024])]
    assert missed == []


def test_single_file_root_and_real_headers(real_headers):
    docs, stats = walk(real_headers)  # extensionless ones included: named explicitly
    assert [d.rel_path for d in docs] == [p.name for p in real_headers]
    for doc, path in zip(docs, real_headers):
        assert doc.source_root == str(path.parent)
        assert doc.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert stats.kept == len(real_headers) and not stats.dropped


def test_bad_roots_fail_at_call_time(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    for root, message in [
        (tmp_path / "nope", "does not exist"),
        (tmp_path / "fifo", "not a directory"),
    ]:
        with pytest.raises(MegaCppError, match=message):
            iter_sources([root], CorpusConfig(), StageStats("sources"))  # not even iterated
    with pytest.raises(MegaCppError, match="no source roots"):
        iter_sources([], CorpusConfig(), StageStats("sources"))


@pytest.mark.timeout(30)  # a FIFO opened for reading without O_NONBLOCK would hang here
def test_hostile_tree_not_following_symlinks(hostile_corpus):
    docs, stats = walk([hostile_corpus.root], CorpusConfig(max_bytes=64 * 1024))
    paths = {d.rel_path for d in docs}
    assert hostile_corpus.kept <= paths
    assert set(hostile_corpus.drops) <= paths  # dropped later, by the filters
    for reason, count in hostile_corpus.source_skips.items():
        assert stats.dropped[reason] == count, reason
    assert stats.seen == stats.kept + sum(
        n for r, n in stats.dropped.items() if r not in ("symlink_skipped", "excluded_dir")
    )


@pytest.mark.timeout(30)
def test_symlinks_followed_with_loops_and_dangling_links(tmp_path, write_tree):
    write_tree(tmp_path, {"real/a.cpp": "int a;", "outside/b.cpp": "int b;"})
    root = tmp_path / "real"
    os.symlink(tmp_path / "outside", root / "linked_dir")
    os.symlink("a.cpp", root / "alias.cpp")  # same file again
    os.symlink(".", root / "self")  # directory loop
    os.symlink("ghost.cpp", root / "dangling.cpp")
    os.symlink("loop2.cpp", root / "loop1.cpp")
    os.symlink("loop1.cpp", root / "loop2.cpp")
    docs, stats = walk([root], CorpusConfig(follow_symlinks=True))
    assert [d.rel_path for d in docs] == ["a.cpp", "linked_dir/b.cpp"]
    assert stats.dropped == {
        "duplicate_path": 1, "symlink_loop": 3, "dangling_symlink": 1,
    }  # fmt: skip
    docs, stats = walk([root])
    assert [d.rel_path for d in docs] == ["a.cpp"]
    assert stats.dropped == {"symlink_skipped": 6}


def test_undecodable_file_names_are_skipped(tmp_path, write_tree):
    write_tree(tmp_path, {"ok.cpp": "int ok;"})
    for name in (b"caf\xe9.cpp", b"bad\xff/inner.cpp"):
        path = os.path.join(os.fsencode(tmp_path), name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(b"int x;")
    docs, stats = walk([tmp_path])
    assert [d.rel_path for d in docs] == ["ok.cpp"]
    assert stats.dropped == {"undecodable_path": 2}


def test_too_large_files_are_not_read(tmp_path, write_tree):
    write_tree(tmp_path, {"big.cpp": "x" * 2000, "ok.cpp": "int x;"})
    docs, stats = walk([tmp_path], CorpusConfig(max_bytes=1000))
    assert [d.rel_path for d in docs] == ["ok.cpp"]
    assert stats.dropped == {"too_large": 1} and stats.bytes_in == 2006


def test_hard_link_and_overlapping_roots_read_once(tmp_path, write_tree):
    write_tree(tmp_path, {"a/x.cpp": "int x;"})
    os.link(tmp_path / "a/x.cpp", tmp_path / "a/y.cpp")
    docs, stats = walk([tmp_path / "a", tmp_path / "a"])
    assert [d.rel_path for d in docs] == ["x.cpp"]
    assert stats.dropped == {"duplicate_path": 2}  # the hard link, then the repeated root


def test_files_vanishing_mid_walk_are_counted(tmp_path, write_tree):
    write_tree(tmp_path, {"a.cpp": "int a;", "b.cpp": "int b;", "sub/c.cpp": "int c;"})
    stats = StageStats("sources")
    stream = iter_sources([tmp_path], CorpusConfig(), stats)
    first = next(stream)  # the root is listed now; b.cpp and sub/ disappear afterwards
    (tmp_path / "b.cpp").unlink()
    shutil.rmtree(tmp_path / "sub")
    rest = list(stream)
    assert first.rel_path == "a.cpp" and rest == []
    assert stats.dropped == {"vanished": 2}


_UNREADABLE_PROBE = textwrap.dedent(
    """
    import json, sys
    from megacpp.data.config import CorpusConfig
    from megacpp.data.pipeline import StageStats
    from megacpp.data.sources import iter_sources
    stats = StageStats("sources")
    docs = [d.rel_path for d in iter_sources([sys.argv[1]], CorpusConfig(), stats)]
    print(json.dumps({"docs": docs, "dropped": dict(stats.dropped)}))
    """
)


def test_unreadable_file_and_directory(tmp_path, write_tree):
    """Permission errors are real here: chmod 000 stops an ordinary user. As root, file modes
    do not stop reads (CAP_DAC_OVERRIDE), so the walk runs in a subprocess started by
    ``setpriv`` without the DAC capabilities -- root without them obeys modes like anyone."""
    write_tree(
        tmp_path, {"ok.cpp": "int ok;", "secret.cpp": "int s;", "locked/inner.cpp": "int i;"}
    )
    (tmp_path / "secret.cpp").chmod(0)
    (tmp_path / "locked").chmod(0)
    command = [sys.executable, "-c", _UNREADABLE_PROBE, str(tmp_path)]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: cannot drop CAP_DAC_OVERRIDE")
        caps = "-dac_override,-dac_read_search"
        command = [setpriv, f"--inh-caps={caps}", f"--bounding-set={caps}", *command]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    finally:
        (tmp_path / "locked").chmod(0o755)
        (tmp_path / "secret.cpp").chmod(0o644)
    assert json.loads(result.stdout) == {"docs": ["ok.cpp"], "dropped": {"unreadable": 2}}
