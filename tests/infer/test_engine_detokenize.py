"""Incremental detokenization and stop-aware text release."""

from __future__ import annotations

import random

from megacpp.infer.detokenize import IncrementalDetokenizer, StopText


def test_deltas_concatenate_to_the_full_decode(tokenizer):
    text = "int f() {\n  return 42; // ünïcødé → λ 😀\n}\n"
    ids = tokenizer.encode(text).tolist()
    ids = ids[:5] + [tokenizer.bos_id] + ids[5:]  # a special token mid-stream is dropped
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) + detok.flush() == tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)  # split characters are held back, not garbled


def test_a_dangling_partial_character_comes_out_at_flush(tokenizer):
    ids = tokenizer.encode("😀").tolist()
    assert len(ids) > 1  # byte-level: one emoji is several tokens at this vocab size
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(ids[0]) == ""
    assert detok.flush() == tokenizer.decode(ids[:1])


def test_stop_text_holds_back_prefixes_and_cuts_at_the_first_stop():
    stop = StopText(("</end>", "\n}"))
    released = [stop.add(d) for d in ["ab", "c<", "/e", "x", "y\n", "}", "tail"]]
    # "<" and "</e" could start "</end>" -> held; "x" breaks it; "\n" held, then "\n}" stops
    assert released == ["ab", "c", "", "</ex", "y", "", ""]
    assert stop.hit == "\n}" and stop.text == "abc</exy"
    assert stop.flush() == ""


def test_stop_text_without_stops_releases_everything():
    stop = StopText(())
    assert stop.add("a") + stop.add("b") + stop.flush() == "ab" and stop.hit is None


def test_a_stop_string_split_over_many_deltas_is_found():
    stop = StopText(("STOP",))
    out = "".join(stop.add(c) for c in "xxSTxSTOPyy")
    assert out == "xxSTx" and stop.hit == "STOP"


def test_random_token_streams_decode_like_the_tokenizer(tokenizer):
    """Any id sequence -- broken UTF-8, specials, ids past the vocabulary -- streams to
    exactly ``tokenizer.decode`` (invalid bytes become U+FFFD in both)."""
    g = random.Random(0)
    for _ in range(200):
        ids = [g.randrange(tokenizer.vocab_size + 5) for _ in range(g.randrange(1, 30))]
        detok = IncrementalDetokenizer(tokenizer)
        text = "".join(detok.add(i) for i in ids) + detok.flush()
        assert text == tokenizer.decode(ids), ids
