"""Mutation check: small wrong edits of the reference solutions must fail the tests.

A mutant changes exactly one token of a canonical solution, found with tree-sitter-cpp in
the solution's part of ``prompt + solution``: a comparison, arithmetic or logical operator
of a binary expression is swapped (``<`` -> ``<=``, ``+`` -> ``-``, ``&&`` -> ``||``...), or an
integer literal is incremented. A mutant is *killed* when its verdict is anything but
passed. Some mutants are equivalent to the original and survive by right; a high kill rate
shows the verifier (and the tests) reject wrong code.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache

import tree_sitter
import tree_sitter_cpp

from megacpp.eval.problems import Problem

OPERATOR_SWAPS = {
    "<": "<=", "<=": "<", ">": ">=", ">=": ">", "==": "!=", "!=": "==",
    "+": "-", "-": "+", "*": "+", "&&": "||", "||": "&&",
}


@dataclass(frozen=True)
class Mutant:
    task_id: str
    description: str  # e.g. "line 4: '<' -> '<='"
    completion: str  # the mutated canonical solution


@lru_cache(maxsize=1)
def _parser() -> tree_sitter.Parser:
    return tree_sitter.Parser(tree_sitter.Language(tree_sitter_cpp.language()))


def mutants(problem: Problem, per_problem: int) -> list[Mutant]:
    """Up to ``per_problem`` single-token mutants, spread evenly over the solution."""
    if problem.canonical_solution is None:
        return []
    prefix = problem.prompt.encode()
    source = prefix + problem.canonical_solution.encode()
    edits = [edit for edit in _edits(_parser().parse(source).root_node, source)
             if edit[0] >= len(prefix)]
    if per_problem < len(edits):
        step = len(edits) / per_problem
        edits = [edits[int(i * step)] for i in range(per_problem)]
    return [_apply(problem, source, len(prefix), *edit) for edit in edits]


def _edits(node: tree_sitter.Node, source: bytes) -> Iterator[tuple[int, int, bytes]]:
    """(start byte, end byte, replacement) for every mutable token, in source order."""
    if node.type == "binary_expression":
        operator = node.child_by_field_name("operator")
        if operator is not None and operator.type in OPERATOR_SWAPS:
            yield operator.start_byte, operator.end_byte, OPERATOR_SWAPS[operator.type].encode()
    elif node.type == "number_literal":
        text = source[node.start_byte:node.end_byte]
        if text.isdigit():
            yield node.start_byte, node.end_byte, str(int(text) + 1).encode()
    for child in node.children:
        yield from _edits(child, source)


def _apply(problem: Problem, source: bytes, prefix_len: int, start: int, end: int,
           replacement: bytes) -> Mutant:
    mutated = source[:start] + replacement + source[end:]
    line = source[prefix_len:start].count(b"\n") + 1
    description = (f"line {line} of the solution: {source[start:end].decode()!r} -> "
                   f"{replacement.decode()!r}")
    return Mutant(problem.task_id, description, mutated[prefix_len:].decode())


def all_mutants(problems: Sequence[Problem], per_problem: int) -> list[Mutant]:
    """The mutants of every problem that has a reference solution (the others have none)."""
    return [mutant for problem in problems for mutant in mutants(problem, per_problem)]
