"""Small problem sets in each layout, written for these tests (shapes as in the public
releases: HumanEval-X, MultiPL-E's humaneval-cpp, MBXP's mbcpp). Small headers keep each
compile cheap."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

HUMANEVALX = [
    {
        "task_id": "CPP/0",
        "prompt": "/*\nAdd two numbers.\n>>> add(2, 3)\n5\n*/\n#include<stdio.h>\n"
                  "using namespace std;\nint add(int x,int y){\n",
        "declaration": "#include<stdio.h>\nusing namespace std;\nint add(int x,int y){\n",
        "canonical_solution": "    return x+y;\n}\n",
        "test": "#undef NDEBUG\n#include<assert.h>\nint main(){\n    assert (add(2,3)==5);\n"
                "    assert (add(-1,1)==0);\n}\n",
        "example_test": "#undef NDEBUG\n#include<assert.h>\nint main(){\n"
                        "    assert (add(2,3)==5);\n}\n",
    },
    {
        "task_id": "CPP/1",
        "prompt": "/*\nThe larger of two numbers.\n*/\n#include<stdio.h>\nusing namespace std;\n"
                  "int larger(int a,int b){\n",
        "declaration": "#include<stdio.h>\nusing namespace std;\nint larger(int a,int b){\n",
        "canonical_solution": "    return a>b?a:b;\n}\n",
        "test": "#undef NDEBUG\n#include<assert.h>\nint main(){\n    assert (larger(1,2)==2);\n"
                "    assert (larger(7,-7)==7);\n}\n",
        "example_test": "",
    },
]

MULTIPL_E = [
    {
        "name": "HumanEval_0_add",
        "language": "cpp",
        "prompt": "#include<assert.h>\n#include<vector>\n// Add two numbers.\n// >>> add((2), (3))\n"
                  "// (5)\nlong add(long x, long y) {\n",
        "doctests": "transform",
        "original": "HumanEval_0_add.py",
        "prompt_terminology": "reworded",
        "tests": "}\nint main() {\n    auto candidate = add;\n    assert(candidate((2), (3)) == (5));\n"
                 "    assert(candidate((-1), (1)) == (0));\n}\n",
        "stop_tokens": ["\n}"],
    },
    {
        "name": "HumanEval_1_sum_vector",
        "language": "cpp",
        "prompt": "#include<assert.h>\n#include<vector>\n// The sum of a vector.\n"
                  "long sum_vector(std::vector<long> xs) {\n",
        "doctests": "transform",
        "original": "HumanEval_1_sum_vector.py",
        "prompt_terminology": "reworded",
        "tests": "}\nint main() {\n    auto candidate = sum_vector;\n"
                 "    assert(candidate((std::vector<long>({(long)1, (long)2, (long)3}))) == (6));\n"
                 "    assert(candidate((std::vector<long>())) == (0));\n}\n",
        "stop_tokens": ["\n}"],
    },
]

_MBXP_TEST = ("\ntemplate <typename T> bool compare(T a, T b){ \n    return a == b; \n}\n\n"
              "int main(int argc, char* argv[]) {\n{calls}    return 0;\n}")
_MBXP_CASE = ("    {type} x{i} = {call};\n    if (!(compare(x{i}, {want}))) {{\n        throw "
              "runtime_error(\"Exception -- test case {i} did not pass.\");\n    }}\n\n")


def _mbxp_test(cases: list[tuple[str, str, str]]) -> str:
    calls = "".join(_MBXP_CASE.format(type=t, i=i, call=c, want=w)
                    for i, (t, c, w) in enumerate(cases))
    return _MBXP_TEST.replace("{calls}", calls)


MBXP = [
    {
        "task_id": "MBCPP/1",
        "prompt": "#include <string>\n#include <stdexcept>\nusing namespace std;\n\n\n/**\n"
                  " * Write a function to repeat a string n times.\n"
                  " * > repeatString(string(\"ab\"), 2)\n * string(\"abab\")\n */\n"
                  "string repeatString(string s, int n) {\n",
        "entry_point": "repeatString",
        "test": _mbxp_test([("string", 'repeatString(string("ab"), 2)', 'string("abab")'),
                            ("string", 'repeatString(string("x"), 0)', 'string("")')]),
        "completion": "    return {};\n}\n",
        "description": "Write a function to repeat a string n times.",
        "language": "cpp",
        "canonical_solution": "    string out;\n    for (int i = 0; i < n; i++) {\n"
                              "        out += s;\n    }\n    return out;\n}",
    },
    {
        "task_id": "MBCPP/2",
        "prompt": "#include <stdexcept>\nusing namespace std;\n\n\n/**\n"
                  " * Write a function to find the cube of a number.\n * > cube(3)\n * 27\n */\n"
                  "int cube(int n) {\n",
        "entry_point": "cube",
        "test": _mbxp_test([("int", "cube(3)", "27"), ("int", "cube(-2)", "-8")]),
        "completion": "    return 0;\n}\n",
        "description": "Write a function to find the cube of a number.",
        "language": "cpp",
        "canonical_solution": None,
    },
]

# An MBXP-shaped problem that needs OpenSSL: it links only with the suite's -lcrypto.
MBXP_MD5 = {
    "task_id": "MBCPP/900",
    "prompt": "#include <openssl/md5.h>\n#include <stdexcept>\nusing namespace std;\n\n\n/**\n"
              " * Write a function that returns the first byte of the MD5 digest of \"a\".\n */\n"
              "int md5FirstByte() {\n",
    "entry_point": "md5FirstByte",
    "test": _mbxp_test([("int", "md5FirstByte()", "0x0c")]),
    "description": "The first MD5 byte of 'a'.",
    "language": "cpp",
    "canonical_solution": "    unsigned char digest[MD5_DIGEST_LENGTH];\n"
                          "    MD5(reinterpret_cast<const unsigned char*>(\"a\"), 1, digest);\n"
                          "    return digest[0];\n}",
}


def write_jsonl(path: Path, records: list[dict]) -> Path:
    """``records`` as JSON Lines; gzip-compressed when ``path`` ends in ``.gz``."""
    text = "".join(json.dumps(record) + "\n" for record in records)
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path
