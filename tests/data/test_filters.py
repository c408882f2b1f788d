"""Per-document filters: every drop reason and note, on documents built from bytes."""

from __future__ import annotations

import hashlib

import pytest

from megacpp.data.config import DEFAULT_GENERATED_MARKERS, CorpusConfig
from megacpp.data.document import Document
from megacpp.data.filters import BinaryFilter, DecodeStep, GeneratedFilter, SizeFilter
from megacpp.data.pipeline import Drop, StageStats, run_steps

CODE = "int add(int a, int b) {\n    return a + b;\n}\n"


def raw_doc(data: bytes, name: str = "f.cpp") -> Document:
    return Document("/src", name, len(data), hashlib.sha256(data).hexdigest(), raw=data)


def text_doc(text: str, name: str = "f.cpp") -> Document:
    data = text.encode()
    return Document("/src", name, len(data), hashlib.sha256(data).hexdigest(), text=text)


def apply(step, doc: Document) -> tuple[Document | Drop, StageStats]:
    stats = StageStats(step.name)
    return step.process(doc, stats), stats


def test_binary_filter():
    assert apply(BinaryFilter(), raw_doc(b"int x;\0\1"))[0] == "binary"
    assert isinstance(apply(BinaryFilter(), raw_doc(CODE.encode()))[0], Document)
    assert apply(BinaryFilter(), text_doc("int x;\0"))[0] == "binary"  # already decoded


def test_decode_strict_drops_non_utf8():
    out, _ = apply(DecodeStep("drop"), raw_doc("// café\n".encode("latin-1")))
    assert out == "non_utf8"


def test_decode_replace_keeps_with_replacement_char_and_note():
    doc = raw_doc(b"// caf\xe9\nint x;\n")
    out, stats = apply(DecodeStep("replace"), doc)
    assert out.text == "// caf\ufffd\nint x;\n" and out.raw is None
    assert stats.notes == {"replaced_invalid_utf8": 1}
    assert out.size == 15 and out.sha256 == hashlib.sha256(b"// caf\xe9\nint x;\n").hexdigest()


def test_decode_strips_bom_and_frees_raw():
    out, stats = apply(DecodeStep(), raw_doc(b"\xef\xbb\xbf" + CODE.encode()))
    assert (out.text, out.raw) == (CODE, None)
    assert stats.notes == {"bom_stripped": 1}


def test_decode_rejects_unknown_policy_and_double_decoding():
    with pytest.raises(ValueError, match="drop"):
        DecodeStep("ignore")
    with pytest.raises(ValueError, match="decoded twice"):
        apply(DecodeStep(), text_doc(CODE))


@pytest.mark.parametrize(
    ("text", "reason"),
    [("", "too_small"), ("int x;", "too_small"), ("x" * 101, "too_large"), (" \n\t" * 20, "blank")],
)
def test_size_filter(text, reason):
    assert apply(SizeFilter(min_bytes=10, max_bytes=100), text_doc(text))[0] == reason


def test_size_filter_keeps_bounds_inclusive():
    step = SizeFilter(min_bytes=6, max_bytes=6)
    assert isinstance(apply(step, text_doc("int x;"))[0], Document)


def generated(**overrides) -> GeneratedFilter:
    cfg = CorpusConfig(**overrides)
    return GeneratedFilter(
        cfg.max_line_length, cfg.max_mean_line_length, cfg.min_alnum_ratio, cfg.generated_markers
    )


@pytest.mark.parametrize("marker", ["// DO NOT EDIT", "/* @generated */", "// Auto-generated file",
                                    "// machine generated, do not edit by hand"])  # fmt: skip
def test_generated_markers_in_the_head(marker):
    assert apply(generated(), text_doc(marker + "\n" + CODE))[0] == "generated_marker"


def test_generated_marker_far_down_is_ignored():
    text = CODE * 60 + "// do not edit below\n"  # > 2 KiB in: a comment, not a header
    assert isinstance(apply(generated(), text_doc(text))[0], Document)


def test_minified_long_line_and_long_mean():
    long_line = CODE + "int table[] = {" + "1," * 600 + "};\n"
    assert apply(generated(), text_doc(long_line))[0] == "minified"
    dense = ("int f" + "x" * 150 + "();\n") * 10  # every line ~160 chars
    assert apply(generated(), text_doc(dense))[0] == "minified"
    assert isinstance(apply(generated(max_mean_line_length=200), text_doc(dense))[0], Document)


def test_low_alnum_ratio():
    art = "/*\n" + ("-=*#|" * 12 + "\n") * 20 + "*/\n" + CODE
    assert apply(generated(), text_doc(art))[0] == "low_alnum"
    assert isinstance(apply(generated(min_alnum_ratio=0.0), text_doc(art))[0], Document)


def test_non_ascii_text_counts_as_alphanumeric():
    text = "// " + "коментар " * 40 + "\n" + CODE
    assert isinstance(apply(generated(), text_doc(text))[0], Document)


def test_real_headers_pass_every_filter(real_headers):
    cfg = CorpusConfig()
    steps = [BinaryFilter(), DecodeStep(), SizeFilter(cfg.min_bytes, cfg.max_bytes), generated()]
    docs = [raw_doc(p.read_bytes(), p.name) for p in real_headers]
    kept, stats = run_steps(docs, steps)
    assert len(list(kept)) == len(real_headers)
    assert all(not s.dropped for s in stats)


def test_default_markers_are_lower_case():
    assert all(m == m.lower() for m in DEFAULT_GENERATED_MARKERS)
