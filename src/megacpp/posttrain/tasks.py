"""A verifiable C++ task set that small models can learn: generated problem families.

Each *family* (``sum_multiples``, ``caesar``, ``rotate_left``, ...) is one kind of function
with parameters; a *variant* is one choice of them (``sum_multiples`` with ``k = 7``). A
variant becomes one problem in the HumanEval-X layout the evaluator reads
(:mod:`megacpp.eval.problems`): a prompt (comment with the task and an example, includes,
the signature, ending inside the body), a reference body (``canonical_solution``) and a
``main()`` of asserts on seeded inputs whose expected values come from a Python oracle.

The split is by variant: within every family some variants go to ``heldout`` and the rest
to ``train``, so a held-out problem asks for a parameter the training set never shows (no
problem, prompt or function name is in both). Generation is seeded: the same seed gives the
same files byte for byte.

:func:`write_task_set` writes ``train.jsonl`` / ``heldout.jsonl`` (problem sets, each with a
``<name>.suite.toml`` sidecar so ``megacpp eval`` builds them with plain ``-std=c++17``),
``train.sft.jsonl`` (``{"prompt", "completion"}`` pairs for ``megacpp posttrain sft``) and
``manifest.json`` (families, variants, split, file hashes).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megacpp._io import atomic_write_json, atomic_write_text, sha256_file
from megacpp.errors import MegaCppError

HEADER = "#include<stdio.h>\n#include<vector>\n#include<string>\nusing namespace std;\n"
SUITE_TOML = ('name = "MegaCpp generated tasks"\nformat = "humanevalx"\nstd = "c++17"\n'
              'flags = ["-O0"]\n')
TASK_PREFIX = "GEN"
LETTERS = "abcdefghijklmnopqrstuvwxyz"
TESTS_PER_PROBLEM = 6


# -- C++ literals -------------------------------------------------------------------------------
def cpp_literal(value: Any) -> str:
    """``value`` (bool, int, str of letters and spaces, list of int) as a C++ expression."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        if any(c not in LETTERS + " " for c in value):
            raise ValueError(f"string literal {value!r}: only lowercase letters and spaces")
        return f'string("{value}")'
    if isinstance(value, list):
        return "vector<int>{" + ", ".join(str(v) for v in value) + "}"
    raise TypeError(f"no C++ literal for {type(value).__name__}")


def doc_literal(value: Any) -> str:
    """``value`` as HumanEval-X docstrings write it (``{1, 2}``, ``"abc"``)."""
    if isinstance(value, list):
        return "{" + ", ".join(str(v) for v in value) + "}"
    if isinstance(value, str):
        return f'"{value}"'
    return cpp_literal(value)


# -- families -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Family:
    """One kind of function. Every callable takes the variant's parameters (a dict)."""

    name: str
    params: dict[str, Sequence[int | str]]  # each parameter's values; variants: the product
    function: Callable[[dict], str]  # the C++ function name
    signature: str  # with {name}: the line before the body, without the opening brace
    doc: Callable[[dict], str]  # one sentence: what the function returns
    body: Callable[[dict], str]  # the reference body (4-space indented lines, no braces)
    oracle: Callable[[dict, Any], Any]  # (params, input) -> expected output
    inputs: Callable[[random.Random], Any]  # one random input (a tuple of arguments)
    valid: Callable[[dict], bool] = lambda p: True  # which parameter choices make a variant

    def variants(self) -> list[dict]:
        keys = list(self.params)
        every = (dict(zip(keys, values)) for values in itertools.product(*self.params.values()))
        return [params for params in every if self.valid(params)]


def _ints(rng: random.Random, low: int = -20, high: int = 20, longest: int = 8) -> list[int]:
    return [rng.randint(low, high) for _ in range(rng.randint(0, longest))]


def _word(rng: random.Random, longest: int = 10) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(0, longest)))


def _sentence(rng: random.Random) -> str:
    return " ".join(_word(rng, 6) for _ in range(rng.randint(1, 4)))


def _signed(value: int) -> str:
    return f"+ {value}" if value >= 0 else f"- {-value}"


def _rotate(v: list[int], k: int) -> list[int]:
    if not v:
        return []
    k %= len(v)
    return v[k:] + v[:k]


def _digit_sum(n: int, base: int) -> int:
    total = 0
    while n > 0:
        total, n = total + n % base, n // base
    return total


def _fib_mod(n: int, m: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, (a + b) % m
    return a


FAMILIES: tuple[Family, ...] = (
    Family(
        "poly", {"a": (1, 2, 3), "b": (-2, -1, 1, 2), "c": (0, 1, 5)},
        lambda p: f"poly_{p['a']}_{p['b']}_{p['c']}".replace("-", "m"),
        "long long {name}(long long x)",
        lambda p: f"Return {p['a']} * x * x {_signed(p['b'])} * x {_signed(p['c'])}.",
        lambda p: f"    return {p['a']} * x * x + ({p['b']}) * x + ({p['c']});\n",
        lambda p, x: p["a"] * x[0] * x[0] + p["b"] * x[0] + p["c"],
        lambda rng: (rng.randint(-50, 50),)),
    Family(
        "sum_multiples", {"k": tuple(range(2, 10))},
        lambda p: f"sum_multiples_of_{p['k']}",
        "long long {name}(vector<int> v)",
        lambda p: f"Return the sum of the elements of v that are divisible by {p['k']}.",
        lambda p: ("    long long total = 0;\n    for (int x : v)\n"
                   f"        if (x % {p['k']} == 0) total += x;\n    return total;\n"),
        lambda p, x: sum(e for e in x[0] if e % p["k"] == 0),
        lambda rng: (_ints(rng),)),
    Family(
        "count_greater", {"t": tuple(range(-4, 9))},
        lambda p: f"count_greater_than_{p['t']}".replace("-", "minus_"),
        "int {name}(vector<int> v)",
        lambda p: f"Return how many elements of v are greater than {p['t']}.",
        lambda p: ("    int count = 0;\n    for (int x : v)\n"
                   f"        if (x > {p['t']}) count++;\n    return count;\n"),
        lambda p, x: sum(e > p["t"] for e in x[0]),
        lambda rng: (_ints(rng),)),
    Family(
        "digit_sum", {"base": tuple(range(2, 11))},
        lambda p: f"digit_sum_base_{p['base']}",
        "int {name}(int n)",
        lambda p: f"Return the sum of the digits of the non-negative integer n written in "
                  f"base {p['base']}.",
        lambda p: ("    int total = 0;\n    while (n > 0) {\n"
                   f"        total += n % {p['base']};\n        n /= {p['base']};\n    }}\n"
                   "    return total;\n"),
        lambda p, x: _digit_sum(x[0], p["base"]),
        lambda rng: (rng.randint(0, 100000),)),
    Family(
        "clamp", {"lo": (-5, -1, 0, 2), "hi": (3, 6, 10)},
        lambda p: f"clamp_{p['lo']}_{p['hi']}".replace("-", "m"),
        "vector<int> {name}(vector<int> v)",
        lambda p: f"Return v with every element below {p['lo']} replaced by {p['lo']} and "
                  f"every element above {p['hi']} replaced by {p['hi']}.",
        lambda p: ("    vector<int> out;\n    for (int x : v) {\n"
                   f"        if (x < {p['lo']}) x = {p['lo']};\n"
                   f"        if (x > {p['hi']}) x = {p['hi']};\n"
                   "        out.push_back(x);\n    }\n    return out;\n"),
        lambda p, x: [min(max(e, p["lo"]), p["hi"]) for e in x[0]],
        lambda rng: (_ints(rng),)),
    Family(
        "rotate_left", {"k": tuple(range(1, 7))},
        lambda p: f"rotate_left_{p['k']}",
        "vector<int> {name}(vector<int> v)",
        lambda p: f"Return v rotated left by {p['k']} positions (the first element moves to "
                  f"the end {p['k']} times); an empty vector stays empty.",
        lambda p: ("    vector<int> out;\n    int n = v.size();\n"
                   "    for (int i = 0; i < n; i++)\n"
                   f"        out.push_back(v[(i + {p['k']}) % n]);\n    return out;\n"),
        lambda p, x: _rotate(x[0], p["k"]),
        lambda rng: (_ints(rng),)),
    Family(
        "caesar", {"shift": tuple(range(1, 26))},
        lambda p: f"caesar_shift_{p['shift']}",
        "string {name}(string s)",
        lambda p: f"Return s with every lowercase letter moved {p['shift']} places forward in "
                  "the alphabet (wrapping from z to a); other characters stay.",
        lambda p: ("    string out = s;\n    for (char &c : out)\n"
                   "        if (c >= 'a' && c <= 'z')\n"
                   f"            c = 'a' + (c - 'a' + {p['shift']}) % 26;\n    return out;\n"),
        lambda p, x: "".join(LETTERS[(LETTERS.index(c) + p["shift"]) % 26] if c in LETTERS
                             else c for c in x[0]),
        lambda rng: (_sentence(rng),)),
    Family(
        "count_char", {"c": tuple(LETTERS[:12])},
        lambda p: f"count_letter_{p['c']}",
        "int {name}(string s)",
        lambda p: f"Return how many times the letter '{p['c']}' occurs in s.",
        lambda p: ("    int count = 0;\n    for (char c : s)\n"
                   f"        if (c == '{p['c']}') count++;\n    return count;\n"),
        lambda p, x: x[0].count(p["c"]),
        lambda rng: (_sentence(rng),)),
    Family(
        "repeat_chars", {"k": (2, 3, 4, 5)},
        lambda p: f"repeat_each_{p['k']}",
        "string {name}(string s)",
        lambda p: f"Return s with every character repeated {p['k']} times in place.",
        lambda p: ("    string out;\n    for (char c : s)\n"
                   f"        out += string({p['k']}, c);\n    return out;\n"),
        lambda p, x: "".join(c * p["k"] for c in x[0]),
        lambda rng: (_word(rng, 6),)),
    Family(
        "power_sum", {"p": (1, 2, 3, 4)},
        lambda p: f"sum_of_powers_{p['p']}",
        "long long {name}(vector<int> v)",
        lambda p: f"Return the sum of x to the power {p['p']} over the elements x of v.",
        lambda p: ("    long long total = 0;\n    for (int x : v) {\n        long long term = 1;\n"
                   f"        for (int i = 0; i < {p['p']}; i++) term *= x;\n"
                   "        total += term;\n    }\n    return total;\n"),
        lambda p, x: sum(e ** p["p"] for e in x[0]),
        lambda rng: (_ints(rng, -9, 9),)),
    Family(
        "keep_mod", {"m": (2, 3, 4, 5), "r": (0, 1, 2)},
        lambda p: f"keep_mod_{p['m']}_is_{p['r']}",
        "vector<int> {name}(vector<int> v)",
        lambda p: f"Return the elements x of v (non-negative integers) with x % {p['m']} == "
                  f"{p['r']}, in their order.",
        lambda p: ("    vector<int> out;\n    for (int x : v)\n"
                   f"        if (x % {p['m']} == {p['r']}) out.push_back(x);\n    return out;\n"),
        lambda p, x: [e for e in x[0] if e % p["m"] == p["r"]],
        lambda rng: (_ints(rng, 0, 30),),
        lambda p: p["r"] < p["m"]),
    Family(
        "window_sum", {"w": (2, 3, 4, 5)},
        lambda p: f"window_sums_{p['w']}",
        "vector<int> {name}(vector<int> v)",
        lambda p: f"Return the sums of every run of {p['w']} consecutive elements of v, from "
                  f"the left (empty when v has fewer than {p['w']} elements).",
        lambda p: ("    vector<int> out;\n"
                   f"    for (int i = 0; i + {p['w']} <= (int)v.size(); i++) {{\n"
                   "        int total = 0;\n"
                   f"        for (int j = i; j < i + {p['w']}; j++) total += v[j];\n"
                   "        out.push_back(total);\n    }\n    return out;\n"),
        lambda p, x: [sum(x[0][i:i + p["w"]]) for i in range(len(x[0]) - p["w"] + 1)],
        lambda rng: (_ints(rng, -20, 20, 9),)),
    Family(
        "replace_char", {"a": tuple("aeiou"), "b": tuple("xyz")},
        lambda p: f"replace_{p['a']}_with_{p['b']}",
        "string {name}(string s)",
        lambda p: f"Return s with every '{p['a']}' replaced by '{p['b']}'.",
        lambda p: ("    for (char &c : s)\n"
                   f"        if (c == '{p['a']}') c = '{p['b']}';\n    return s;\n"),
        lambda p, x: x[0].replace(p["a"], p["b"]),
        lambda rng: (_sentence(rng),)),
    Family(
        "fib_mod", {"m": (2, 3, 5, 7, 10, 11, 13, 17, 100, 1000)},
        lambda p: f"fib_mod_{p['m']}",
        "int {name}(int n)",
        lambda p: f"Return the n-th Fibonacci number (fib(0) = 0, fib(1) = 1) modulo {p['m']}.",
        lambda p: ("    int a = 0, b = 1;\n    for (int i = 0; i < n; i++) {\n"
                   f"        int next = (a + b) % {p['m']};\n        a = b;\n        b = next;\n"
                   "    }\n    return a;\n"),
        lambda p, x: _fib_mod(x[0], p["m"]),
        lambda rng: (rng.randint(0, 60),)),
)
FAMILY_NAMES = tuple(f.name for f in FAMILIES)


# -- problems -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Task:
    family: str
    variant: str  # the parameters as text, e.g. "k=7"
    split: str  # "train" | "heldout"
    record: dict[str, str]  # the problem in the HumanEval-X layout


def variant_key(params: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in params.items())


def make_problem(family: Family, params: dict, seed: int) -> dict[str, str]:
    """One problem (HumanEval-X layout) for ``family`` with ``params``; its test inputs are
    drawn from a generator seeded with the seed, family and variant."""
    rng = random.Random(f"{seed}:{family.name}:{variant_key(params)}")
    name = family.function(params)
    signature = family.signature.format(name=name)
    inputs: list[tuple] = []
    while len(inputs) < TESTS_PER_PROBLEM + 1:
        args = family.inputs(rng)
        if args not in inputs:
            inputs.append(args)
    example, tests = inputs[0], inputs[1:]

    def call(args: tuple) -> str:
        return f"{name}({', '.join(cpp_literal(a) for a in args)})"

    def check(args: tuple) -> str:
        expected = cpp_literal(family.oracle(params, args))
        if expected.startswith("vector"):  # its commas would split assert's macro argument
            expected = f"({expected})"
        return f"    assert ({call(args)} == {expected});\n"

    example_doc = (f">>> {name}({', '.join(doc_literal(a) for a in example)})\n"
                   f"{doc_literal(family.oracle(params, example))}\n")
    prompt = f"/*\n{family.doc(params)}\n{example_doc}*/\n{HEADER}{signature}{{\n"
    main = "#undef NDEBUG\n#include<assert.h>\nint main(){\n"
    return {
        "task_id": f"{TASK_PREFIX}/{family.name}/{variant_key(params)}",
        "prompt": prompt,
        "canonical_solution": family.body(params) + "}\n",
        "test": main + "".join(check(args) for args in tests) + "}\n",
        "declaration": f"{HEADER}{signature}{{\n",
        "example_test": main + check(example) + "}\n",
    }


def generate_tasks(seed: int = 0, heldout_fraction: float = 0.25,
                   per_family: int | None = None,
                   families: Sequence[str] = ()) -> list[Task]:
    """Every family's variants (a seeded sample of ``per_family`` when given), each assigned
    to ``train`` or ``heldout``: per family, round(fraction * variants) held out, at least
    one of each."""
    if not 0 < heldout_fraction < 1:
        raise MegaCppError(f"held-out fraction {heldout_fraction}: expected a number in (0, 1)")
    if per_family is not None and per_family < 2:
        raise MegaCppError(f"variants per family {per_family}: expected >= 2 (one train, one "
                           "held out)")
    unknown = [name for name in families if name not in FAMILY_NAMES]
    if unknown:
        raise MegaCppError(f"unknown task family {unknown[0]!r}; families: "
                           f"{', '.join(FAMILY_NAMES)}")
    tasks: list[Task] = []
    for family in FAMILIES:
        if families and family.name not in families:
            continue
        variants = family.variants()
        random.Random(f"{seed}:{family.name}:variants").shuffle(variants)
        if per_family is not None:
            variants = variants[:per_family]
        held = min(max(1, round(heldout_fraction * len(variants))), len(variants) - 1)
        for index, params in enumerate(variants):
            split = "heldout" if index < held else "train"
            tasks.append(Task(family.name, variant_key(params), split,
                              make_problem(family, params, seed)))
    check_no_leakage(tasks)
    return tasks


def check_no_leakage(tasks: Sequence[Task]) -> None:
    """No task id, prompt, function declaration or test is in both splits."""
    for field in ("task_id", "prompt", "declaration", "test"):
        train = {t.record[field] for t in tasks if t.split == "train"}
        heldout = {t.record[field] for t in tasks if t.split == "heldout"}
        both = train & heldout
        if both:
            raise MegaCppError(f"the generated splits share a {field}: {min(both)[:80]!r}")


def write_task_set(out: str | Path, seed: int = 0, heldout_fraction: float = 0.25,
                   per_family: int | None = None, families: Sequence[str] = ()) -> dict[str, Any]:
    """Write the task set into ``out``; returns the manifest (also ``manifest.json``)."""
    tasks = generate_tasks(seed, heldout_fraction, per_family, families)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    for split in ("train", "heldout"):
        records = [t.record for t in tasks if t.split == split]
        files[split] = atomic_write_text(out / f"{split}.jsonl", _jsonl(records))
        files[f"{split}_suite"] = atomic_write_text(out / f"{split}.suite.toml", SUITE_TOML)
    sft = [{"task_id": t.record["task_id"], "prompt": t.record["prompt"],
            "completion": t.record["canonical_solution"]} for t in tasks if t.split == "train"]
    files["train_sft"] = atomic_write_text(out / "train.sft.jsonl", _jsonl(sft))
    manifest = {
        "seed": seed,
        "heldout_fraction": heldout_fraction,
        "per_family": per_family,
        "families": {family: {split: [t.variant for t in tasks
                                      if t.family == family and t.split == split]
                              for split in ("train", "heldout")}
                     for family in dict.fromkeys(t.family for t in tasks)},
        "counts": {split: sum(t.split == split for t in tasks) for split in ("train", "heldout")},
        "files": {key: {"path": path.name, "sha256": sha256_file(path)}
                  for key, path in files.items()},
    }
    atomic_write_json(out / "manifest.json", manifest)
    return manifest


def _jsonl(records: Sequence[dict]) -> str:
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)


def prompt_digest(prompt: str) -> str:
    """A whitespace-insensitive digest of a prompt (how training data is checked against
    eval-only sets)."""
    return hashlib.sha256(" ".join(prompt.split()).encode("utf-8")).hexdigest()
