"""Incremental, stop-aware detokenization for streaming.

:class:`IncrementalDetokenizer` turns one token at a time into text: megacpp tokenizers are
byte-level BPE, so a token *is* a byte string (specials are empty, as ``decode`` skips them);
the bytes go through an incremental UTF-8 decoder, which holds back a character split across
tokens until it is complete (and replaces invalid bytes, as the tokenizer's decoder does). The
concatenated deltas equal ``tokenizer.decode(all tokens)``, at about a microsecond per token
(no tokenizer call per step). Each tokenizer's byte table is built once.

:class:`StopText` sits on top: it accumulates the text, finds the first stop string, and
releases only text that can no longer turn out to be part of a stop string (a suffix that
is a prefix of some stop string is held back until the next token decides).
"""

from __future__ import annotations

import codecs
import weakref

from megacpp.data.tokenizer import _CHAR_TO_BYTE, CppTokenizer
from megacpp.errors import MegaCppError

_TABLES: weakref.WeakKeyDictionary[CppTokenizer, list[bytes]] = weakref.WeakKeyDictionary()


def token_bytes(tokenizer: CppTokenizer) -> list[bytes]:
    """The bytes each token id stands for (b"" for special tokens)."""
    if tokenizer not in _TABLES:
        hf = tokenizer.hf
        special = {i for i, t in hf.get_added_tokens_decoder().items() if t.special}
        table = []
        for i in range(hf.get_vocab_size()):
            piece = "" if i in special else hf.id_to_token(i)
            if piece is None or any(c not in _CHAR_TO_BYTE for c in piece):
                raise MegaCppError(f"token {i} ({piece!r}) is not a byte-level token")
            table.append(bytes(_CHAR_TO_BYTE[c] for c in piece))
        _TABLES[tokenizer] = table
    return _TABLES[tokenizer]


class IncrementalDetokenizer:
    """Token ids in, text deltas out (specials dropped, as ``CppTokenizer.decode`` does;
    ids past the vocabulary decode to nothing, as there)."""

    def __init__(self, tokenizer: CppTokenizer) -> None:
        self._table = token_bytes(tokenizer)
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token_id: int) -> str:
        """Append one token; the text it completes (may be empty)."""
        piece = self._table[token_id] if 0 <= token_id < len(self._table) else b""
        return self._utf8.decode(piece)

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        return self._utf8.decode(b"", final=True)


class StopText:
    """The completion text so far, cut at the first stop string; emits only safe text."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = stop
        self._longest = max((len(s) for s in stop), default=0)
        self.text = ""
        self.emitted = 0  # characters of ``text`` already released
        self.hit: str | None = None  # the stop string that ended the text

    def add(self, delta: str) -> str:
        """Append ``delta``; return the text now safe to release. After a stop string is
        found, ``hit`` is set, ``text`` ends right before it, and nothing more is taken."""
        if self.hit is not None or not delta:
            return ""
        start = max(0, len(self.text) - self._longest + 1)
        self.text += delta
        if self.stop:
            found = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if found:
                cut, self.hit = min(found)
                self.text = self.text[:cut]
                return self._release(len(self.text))
        return self._release(len(self.text) - self._held_back())

    def flush(self) -> str:
        """Release everything (the completion ended for another reason)."""
        return self._release(len(self.text))

    def _held_back(self) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        for n in range(min(self._longest - 1, len(self.text) - self.emitted), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def _release(self, end: int) -> str:
        out = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return out
