"""The encoder's native pre-tokenizer and piece index (``pretokenize.cpp``, through ctypes).

It splits texts into exactly the pieces of :data:`~megacpp.data.tokenizer.PRETOKENIZE_PATTERN`
and maps every piece to a row of a growing index, at C++ speed; the tokenizer keeps the BPE
tokens of each row (:class:`~megacpp.data.tokenizer.CppTokenizer`). Python's ``re`` path is the
reference it is tested against, and the fallback: the library is compiled with ``g++`` on
first use and cached (see :mod:`megacpp._build`); without a compiler, or with
``MEGACPP_NATIVE=0``, :func:`native_library` returns None and the encoder stays pure Python
(same ids). :func:`native_status` says which and why.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np

from megacpp._build import compiled
from megacpp.errors import MegaCppError

SOURCE = Path(__file__).with_name("pretokenize.cpp")
_FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror")
_I64P = ctypes.POINTER(ctypes.c_int64)
_state: dict[str, object] = {}


def native_library() -> ctypes.CDLL | None:
    """The loaded library, or None (pure-Python encoding; :func:`native_status` says why)."""
    if "lib" not in _state:
        _state["lib"], _state["status"] = _load()
    return _state["lib"]  # type: ignore[return-value]


def native_status() -> str:
    """``"native"`` or why the encoder runs in pure Python."""
    native_library()
    return str(_state["status"])


def _load() -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get("MEGACPP_NATIVE", "1") == "0":
        return None, "pure Python (MEGACPP_NATIVE=0)"
    try:
        path = compiled(SOURCE, "native", "pretokenize", ("g++", "c++"), _FLAGS,
                        "native pre-tokenizer")
        lib = ctypes.CDLL(str(path))
    except (MegaCppError, OSError) as exc:
        return None, f"pure Python ({str(exc).splitlines()[0]})"
    lib.megacpp_index_new.restype = ctypes.c_void_p
    lib.megacpp_index_free.argtypes = [ctypes.c_void_p]
    lib.megacpp_index_size.argtypes = [ctypes.c_void_p]
    lib.megacpp_index_size.restype = ctypes.c_int64
    lib.megacpp_index_clear.argtypes = [ctypes.c_void_p]
    lib.megacpp_pretokenize.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _I64P,
                                        ctypes.c_int64, _I64P, _I64P, _I64P]
    lib.megacpp_pretokenize.restype = ctypes.c_int64
    return lib, "native"


class PieceIndex:
    """Rows of distinct pieces, assigned in order of first appearance (row = index size)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._handle = ctypes.c_void_p(lib.megacpp_index_new())

    def __len__(self) -> int:
        return self._lib.megacpp_index_size(self._handle)

    def clear(self) -> None:
        self._lib.megacpp_index_clear(self._handle)

    def rows(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """(rows int64[pieces] of all texts' pieces one text after another, pieces per text
        int64[len(texts)], the pieces new to the index in row order)."""
        data = [t.encode("utf-8", "surrogatepass") for t in texts]
        offsets = np.zeros(len(data) + 1, dtype=np.int64)
        np.cumsum([len(d) for d in data], out=offsets[1:])
        buf = b"".join(data)
        rows = np.empty(len(buf), dtype=np.int64)  # a piece has >= 1 byte
        counts = np.empty(len(data), dtype=np.int64)
        spans = np.empty(2 * len(buf), dtype=np.int64)
        n_new = self._lib.megacpp_pretokenize(
            self._handle, buf, _ptr(offsets), len(data), _ptr(rows), _ptr(counts), _ptr(spans)
        )
        spans = spans[: 2 * n_new].reshape(-1, 2).tolist()  # [new, 2] byte (start, end)
        new = [buf[a:b].decode("utf-8", "surrogatepass") for a, b in spans]
        return rows[: int(counts.sum())], counts, new

    def __del__(self) -> None:
        lib, handle = getattr(self, "_lib", None), getattr(self, "_handle", None)
        if lib is not None and handle is not None:
            lib.megacpp_index_free(handle)


def _ptr(a: np.ndarray) -> ctypes._Pointer:
    return a.ctypes.data_as(_I64P)
