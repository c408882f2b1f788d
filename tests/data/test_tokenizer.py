"""The C++ tokenizer: reserved vocabulary, specials, byte-exact round trip, the fast encoder's
equality with HF ``tokenizers``, loading by HF and transformers, refusal of foreign files."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from megacpp.data.native import PieceIndex, native_library, native_status
from megacpp.data.tokenizer import (
    _PIECE_RE,
    SPECIAL_TOKENS,
    CppTokenizer,
    compare_with_plain_bpe,
    reserved_budget,
    reserved_strings,
    split_units,
    train_plain_bpe,
    train_tokenizer,
)
from megacpp.errors import MegaCppError
from tests.data.packed_fixtures import SYNTHETIC, real_texts

VOCAB = 512


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return real_texts() + list(SYNTHETIC.values())


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory, corpus) -> str:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    CppTokenizer.from_hf(train_tokenizer(corpus, VOCAB)).save(path)
    return str(path)


@pytest.fixture(scope="module")
def tok(tok_file) -> CppTokenizer:
    return CppTokenizer.load(tok_file)


def _hf(tok_file: str) -> Tokenizer:
    hf = Tokenizer.from_file(tok_file)
    hf.encode_special_tokens = True  # literal "<|eos|>" in source code is text
    return hf


def test_vocab_size_specials_and_reserved(tok):
    assert tok.vocab_size == VOCAB
    assert [tok.hf.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    wanted = reserved_strings()[: reserved_budget(VOCAB)]
    assert len(wanted) == reserved_budget(VOCAB) > 40
    not_single = [w for w in wanted if len(tok.encode(w)) != 1]
    assert not_single == []


def test_large_vocab_reserves_everything(corpus):
    hf = train_tokenizer(corpus[:4], 2048)
    tok = CppTokenizer.from_hf(hf)
    assert tok.vocab_size == 2048
    for word in ("static_assert", " reinterpret_cast", "<=>", " unique_ptr", "co_await"):
        assert len(tok.encode(word)) == 1, word


def test_pretokenizer_pieces():
    assert _PIECE_RE.findall("if (x) {\n        return 42;") == [
        "if",
        " (",
        "x",
        ")",
        " {",
        "\n        ",
        "return",
        " 4",
        "2",
        ";",
    ]
    assert _PIECE_RE.findall("a   = b;\t\n") == ["a", "  ", " =", " b", ";", "\t", "\n"]
    assert _PIECE_RE.findall("std::vector<int> v;") == [
        "std",
        "::",
        "vector",
        "<",
        "int",
        ">",
        " v",
        ";",
    ]
    assert _PIECE_RE.findall("// é ✓\r\n") == ["//", " é", " ✓", "\r\n"]


HOSTILE_TEXTS = [
    "",
    " ",
    "a \t \n\r\n  \r\r\n\x0b\x0c\x00\x1f\x7f x",
    "\u00a0\u0085\u2028 é  é\t✓ 𝄞x",  # Unicode spaces (``\\s`` in str patterns), astral
    "  \u00e9  \u00a0 a  \x85b",
    "int\u00a0x = 'é';  // ☃\n\t\t  \n",
    "x <|eos|> y",
    "\r",
    "\n\n  \t\r\n \t",
]


def test_round_trip_real_and_synthetic(tok, corpus):
    for text, ids in zip(corpus, tok.encode_batch(corpus)):
        assert ids.dtype == np.int32
        assert tok.decode(ids) == text
        assert int(tok.token_nbytes[ids].sum()) == len(text.encode("utf-8"))


def test_fast_encoder_equals_hf(tok, tok_file, corpus):
    hf = _hf(tok_file)
    texts = corpus + HOSTILE_TEXTS + ["x <|eos|> y <|bos|>", "\x00\x01\r\r\n\x0b", "  \t \n"]
    ours = tok.encode_batch(texts)
    ref = hf.encode_batch(texts, add_special_tokens=False)
    for text, a, b in zip(texts, ours, ref):
        assert a.tolist() == b.ids, repr(text[:60])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=200))
def test_fast_encoder_equals_hf_and_round_trips_any_text(tok, tok_file, text):
    ids = tok.encode(text)
    assert ids.tolist() == _hf(tok_file).encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text


NEWLINE_HEAVY = st.text(alphabet=" \t\r\n\x0bab{}é", max_size=80)


@settings(max_examples=400, deadline=None)
@given(NEWLINE_HEAVY | st.text(alphabet=st.characters(codec="utf-8"), max_size=120))
def test_units_cut_only_at_piece_boundaries(text):
    """The encoder caches lines and newline runs: their pieces, unit by unit, must be the
    pieces of the whole text (CRLF, lone CR, blank and space-only lines, indentation)."""
    units = split_units(text)
    assert "".join(units) == text
    assert [p for u in units for p in _PIECE_RE.findall(u)] == _PIECE_RE.findall(text)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(NEWLINE_HEAVY)
def test_fast_encoder_equals_hf_on_newline_heavy_text(tok, tok_file, text):
    assert tok.encode(text).tolist() == _hf(tok_file).encode(text, add_special_tokens=False).ids


def test_loadable_by_transformers(tok, tok_file, corpus):
    from transformers import PreTrainedTokenizerFast

    # split_special_tokens: a literal "<|eos|>" in source code is text (hostile.cpp has some)
    fast = PreTrainedTokenizerFast(
        tokenizer_file=tok_file,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        split_special_tokens=True,
    )
    assert (fast.bos_token_id, fast.eos_token_id, fast.pad_token_id) == (1, 2, 0)
    for text in (SYNTHETIC["src/hostile.cpp"], corpus[0]):
        assert fast.encode(text, add_special_tokens=False) == tok.encode(text).tolist()
        assert fast.decode(tok.encode(text)) == text


def test_compare_with_plain_bpe_measures_both(corpus):
    result = compare_with_plain_bpe(corpus[::2], corpus[1::2], VOCAB)
    assert result["heldout_documents"] == len(corpus[1::2])
    assert 1.0 < result["megacpp_bytes_per_token"] < 10
    assert 1.0 < result["plain_bpe_bytes_per_token"] < 10


def test_load_refuses_foreign_and_broken_files(tmp_path, corpus):
    plain = tmp_path / "plain.json"
    train_plain_bpe(corpus[:3], 300).save(str(plain))
    with pytest.raises(MegaCppError, match="not a megacpp tokenizer"):
        CppTokenizer.load(plain)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(MegaCppError, match="not a valid tokenizer.json"):
        CppTokenizer.load(broken)
    with pytest.raises(MegaCppError, match="tokenizer .* does not exist"):
        CppTokenizer.load(tmp_path / "missing.json")


def test_vocab_size_out_of_range(corpus):
    with pytest.raises(MegaCppError, match="vocab_size 100 is out of range"):
        train_tokenizer(corpus[:1], 100)


def test_saved_file_is_deterministic(tmp_path, corpus):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    CppTokenizer.from_hf(train_tokenizer(corpus[:5], 400)).save(a)
    CppTokenizer.from_hf(train_tokenizer(corpus[:5], 400)).save(b)
    assert json.loads(a.read_text()) == json.loads(b.read_text())


@settings(max_examples=400, deadline=None)
@given(NEWLINE_HEAVY | st.text(alphabet=st.characters(codec="utf-8"), max_size=120))
def test_native_pretokenizer_equals_the_pattern(text):
    """The C++ pre-tokenizer splits any text into exactly the pattern's pieces (Python ``re``
    is the reference), and its index hands out rows in order of first appearance."""
    lib = native_library()
    if lib is None:
        pytest.skip(native_status())
    index = PieceIndex(lib)
    rows, per_text, new = index.rows([text, text])
    expected = _PIECE_RE.findall(text)
    assert new == list(dict.fromkeys(expected))  # a fresh index: every distinct piece, in order
    assert per_text.tolist() == [len(expected)] * 2
    assert [new[r] for r in rows.tolist()] == expected * 2
    assert len(index) == len(new)


def test_native_and_python_encoders_agree(tok, corpus):
    """The two encoder paths give the same ids (the Python one is the native one's reference;
    ``MEGACPP_NATIVE=0`` or a missing g++ selects it)."""
    if native_library() is None:
        pytest.skip(native_status())
    texts = corpus + HOSTILE_TEXTS
    native = CppTokenizer.from_hf(tok.hf)
    python = CppTokenizer.from_hf(tok.hf)
    python._native = None
    for a, b in zip(native.encode_batch(texts), python.encode_batch(texts)):
        assert a.tolist() == b.tolist()
    assert native._native and len(native._native[0]) > 0 and len(python._units._row_of) > 0


def test_without_a_compiler_the_encoder_stays_pure_python(monkeypatch, tmp_path):
    """No g++ on PATH (and no cached build): the native library is unavailable, says why,
    and a tokenizer encodes through the Python path."""
    from megacpp.data import native

    monkeypatch.setenv("MEGACPP_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(native, "_state", {})
    assert native.native_library() is None
    assert native.native_status().startswith("pure Python (no compiler (g++ or c++) on PATH")
    monkeypatch.setenv("MEGACPP_NATIVE", "0")
    monkeypatch.setattr(native, "_state", {})
    assert native.native_status() == "pure Python (MEGACPP_NATIVE=0)"
