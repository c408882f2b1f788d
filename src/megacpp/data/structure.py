"""Structure ids: for every token, which syntactic region of C++ it sits in.

tree-sitter's C++ grammar parses each document; a query (run in C) captures the regions below;
each region paints its byte span in a ``uint8`` array, outer regions first, so the innermost
region wins; a token takes the label of its *last* byte (so ``" //"`` is a comment token and
``"\\n    "`` belongs to the block it indents). Painting is one ``memset`` per captured region
and the token lookup is one vectorized gather: linear in the document size.

A document whose parse times out keeps its tokens and gets :attr:`Structure.OTHER` everywhere
(counted as ``parse_timeout``); a parse with syntax errors (tree-sitter recovers and still
returns a tree: unexpanded macros are common in real headers) is labelled from the recovered
tree and counted as ``parse_errors``.
"""

from __future__ import annotations

import time
from enum import IntEnum

import numpy as np
import tree_sitter
import tree_sitter_cpp


class Structure(IntEnum):
    """The structure id of a token (``structure_ids`` in shards and batches)."""

    OTHER = 0  # top-level code outside the regions below; also BOS/EOS/padding and fallback
    PREPROCESSOR = 1  # #include/#define/#pragma lines; #if/#ifdef/#else/#endif lines
    COMMENT = 2
    STRING = 3  # string, raw string, char literals; <header> in #include
    NAMESPACE = 4  # inside a namespace definition (not in a nested region)
    CLASS_BODY = 5  # between the braces of a class/struct/union
    FUNCTION_SIGNATURE = 6  # a function definition's head; a function declaration
    FUNCTION_BODY = 7  # a function's or lambda's body
    TEMPLATE_PARAMS = 8  # template <...> parameter list


NUM_STRUCTURE_IDS = len(Structure)

# capture name -> structure id. The query runs inside tree-sitter (C).
_CAPTURES = {
    "preproc": Structure.PREPROCESSOR,
    "comment": Structure.COMMENT,
    "string": Structure.STRING,
    "namespace": Structure.NAMESPACE,
    "class_body": Structure.CLASS_BODY,
    "signature": Structure.FUNCTION_SIGNATURE,
    "body": Structure.FUNCTION_BODY,
    "template_params": Structure.TEMPLATE_PARAMS,
}
_QUERY = """
[(preproc_include) (preproc_def) (preproc_function_def) (preproc_call)] @preproc
["#if" "#ifdef" "#ifndef" "#else" "#elif" "#elifdef" "#elifndef" "#endif"] @preproc
(preproc_if condition: (_) @preproc)
(preproc_elif condition: (_) @preproc)
(preproc_ifdef name: (_) @preproc)
(preproc_elifdef name: (_) @preproc)
(comment) @comment
[(string_literal) (raw_string_literal) (char_literal) (system_lib_string)] @string
(namespace_definition) @namespace
(field_declaration_list) @class_body
(function_definition) @signature
(declaration declarator: (function_declarator)) @signature
(field_declaration declarator: (function_declarator)) @signature
(function_definition body: (_) @body)
(lambda_expression body: (_) @body)
(template_parameter_list) @template_params
"""
# Ties (two regions with the same span) go to the larger id, painted last.

_CAPTURE_IDS = {name: int(sid) for name, sid in _CAPTURES.items()}  # plain ints sort fastest

_READ_CHUNK = 1 << 16  # bytes handed to tree-sitter per read (it checks the deadline between)

PARSE_OK, PARSE_ERRORS, PARSE_TIMEOUT = "parsed", "parse_errors", "parse_timeout"
PARSE_TOO_LARGE = "too_large_to_parse"
# Larger documents are not parsed (all OTHER): a syntax tree costs ~60 bytes per source byte.
MAX_PARSE_BYTES = 4 << 20


class StructureLabeler:
    """Labels documents with :class:`Structure` ids. One per process (holds a parser)."""

    def __init__(self, timeout_s: float = 5.0) -> None:
        language = tree_sitter.Language(tree_sitter_cpp.language())
        self._parser = tree_sitter.Parser(language)
        self._query = tree_sitter.Query(language, _QUERY)
        self.timeout_s = timeout_s

    def byte_labels(self, source: bytes) -> tuple[np.ndarray, str]:
        """uint8[len(source)] structure id of every byte, and the parse outcome
        (:data:`PARSE_OK`, :data:`PARSE_ERRORS`, :data:`PARSE_TIMEOUT` or
        :data:`PARSE_TOO_LARGE`)."""
        labels = np.zeros(len(source), dtype=np.uint8)
        if len(source) > MAX_PARSE_BYTES:
            return labels, PARSE_TOO_LARGE
        tree = self._parse(source)
        if tree is None:
            return labels, PARSE_TIMEOUT
        for start, neg_end, sid in self._regions(tree):
            labels[start:-neg_end] = sid  # -neg_end: the region's end
        return labels, PARSE_ERRORS if tree.root_node.has_error else PARSE_OK

    def token_labels(self, source: bytes, token_ends: np.ndarray) -> tuple[np.ndarray, str]:
        """uint8[n_tokens] structure ids for tokens ending at byte offsets ``token_ends``
        (exclusive; every token covers at least one byte)."""
        labels, outcome = self.byte_labels(source)
        if len(token_ends) == 0:
            return np.zeros(0, dtype=np.uint8), outcome
        return labels[np.asarray(token_ends) - 1], outcome

    def _parse(self, source: bytes) -> tree_sitter.Tree | None:
        deadline = time.monotonic() + self.timeout_s

        def read(offset: int, _point: tuple[int, int]) -> bytes:
            return source[offset : offset + _READ_CHUNK]

        def past_deadline(_offset: int, _has_error: bool) -> bool:
            return time.monotonic() > deadline

        try:
            return self._parser.parse(read, progress_callback=past_deadline)
        except ValueError:  # tree-sitter's "Parsing failed": cancelled at the deadline
            return None

    def _regions(self, tree: tree_sitter.Tree) -> list[tuple[int, int, int]]:
        """``(start, -end, id)`` of the captured regions, sorted (by start, then longest
        first, then id) so that enclosing regions come before enclosed ones. Plain tuples:
        a document has ~100 regions, too few for numpy's per-call overhead to pay off."""
        spans: list[tuple[int, int, int]] = []
        captures = tree_sitter.QueryCursor(self._query).captures(tree.root_node)
        for name, nodes in captures.items():
            sid = _CAPTURE_IDS[name]
            spans += [(node.start_byte, -node.end_byte, sid) for node in nodes]
        spans.sort()
        return spans


def token_ends(ids: np.ndarray, token_nbytes: np.ndarray) -> np.ndarray:
    """int64[n] exclusive end byte offset of each token of a document (cumulative lengths)."""
    return np.cumsum(token_nbytes[ids], dtype=np.int64)
