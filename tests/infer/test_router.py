"""The router: the naive-Bayes snippet classifier (features, fit, JSON round trip, fail-closed
loading), routing rules, and a real server that routes by ``model`` and by ``auto``."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from megacpp.errors import MegaCppError
from megacpp.infer.router import (
    AUTO,
    Router,
    SnippetClassifier,
    UnknownModel,
    features,
    labelled_snippets,
    lexical_tokens,
    snippets,
    train_router,
)
from tests.infer.server_helpers import live_server, tiny_specialist

# Two "corpus sources" with distinct C++ styles: STL-like templates vs. a C-style crypto API.
STL = [
    ("template <typename _Tp, typename _Alloc>\nclass vector : protected _Vector_base<_Tp> {\n"
    "  typedef _Tp value_type;\n  iterator begin() noexcept { return iterator(this->_M_start); }"),
    ("template <class _InputIterator, class _Predicate>\n_InputIterator\n"
    "find_if(_InputIterator __first, _InputIterator __last, _Predicate __pred)\n"
    "{ while (__first != __last && !__pred(*__first)) ++__first; return __first; }"),
    ("namespace std _GLIBCXX_VISIBILITY(default) {\n  template<typename _Tp>\n"
    "    constexpr _Tp&& forward(typename std::remove_reference<_Tp>::type& __t) noexcept"),
]
CRYPTO = [
    ("int EVP_EncryptInit_ex(EVP_CIPHER_CTX *ctx, const EVP_CIPHER *cipher, ENGINE *impl,\n"
    "                       const unsigned char *key, const unsigned char *iv);"),
    ("EVP_MD_CTX *mdctx = EVP_MD_CTX_new();\nif (mdctx == NULL) return 0;\n"
    "if (1 != EVP_DigestInit_ex(mdctx, EVP_sha256(), NULL)) goto err;"),
    ("void BN_free(BIGNUM *a);\nint BN_num_bits(const BIGNUM *a);\n"
    "BIGNUM *BN_bin2bn(const unsigned char *s, int len, BIGNUM *ret);"),
]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def clf() -> SnippetClassifier:
    return SnippetClassifier.fit(STL + CRYPTO, ["stl"] * 3 + ["crypto"] * 3)


def test_features_are_cpp_tokens_with_literal_placeholders():
    toks = lexical_tokens('x = f("hi", \'c\', 0x1f); // gone\n/* gone */ y->z;')
    assert toks == ["x", "=", "f", "(", "<str>", ",", "<chr>", ",", "<num>", ")", ";",
                    "y", "->", "z", ";"]
    counts = features("a + a")
    assert counts["a"] == 2 and counts["a +"] == 1 and counts["+ a"] == 1
    assert list(snippets("1\n2\n3\n\n\n", 2)) == ["1\n2\n", "3\n\n"]


def test_classifier_separates_sources_and_round_trips(clf, tmp_path):
    assert clf.predict("template <typename _Tp> _Tp&& __t")[0] == "stl"
    label, p = clf.predict("EVP_CIPHER_CTX *ctx = NULL; BIGNUM *bn;")
    assert label == "crypto" and 0.5 < p <= 1.0
    assert clf.predict("// only a comment") == (None, 0.0)
    again = SnippetClassifier.load(clf.save(tmp_path / "r.json"))
    for text in STL + CRYPTO + ["int main() { return 0; }"]:
        assert again.predict(text) == clf.predict(text)
        assert again.log_likelihoods(text).tolist() == clf.log_likelihoods(text).tolist()
    small = SnippetClassifier.fit(STL + CRYPTO, ["stl"] * 3 + ["crypto"] * 3, max_features=5)
    assert len(small.vocab) == 5


def test_bad_router_files_fail_closed(clf, tmp_path):
    bad = tmp_path / "bad.json"
    cases = [("not json", "not valid JSON"), (json.dumps({"format": "x"}), "not a megacpp router"),
             (json.dumps({**clf.to_dict(), "version": 99}), "version"),
             (json.dumps({**clf.to_dict(), "counts": [[1, 2]]}), "shape")]
    for text, needle in cases:
        bad.write_text(text)
        with pytest.raises(MegaCppError, match=needle):
            SnippetClassifier.load(bad)
    with pytest.raises(MegaCppError, match="does not exist"):
        SnippetClassifier.load(tmp_path / "missing.json")
    with pytest.raises(MegaCppError, match=">= 2 sources"):
        SnippetClassifier.fit(STL, ["stl"] * 3)


def test_routing_rules(clf):
    router = Router(["stl", "crypto"], clf)
    assert router.route("crypto", "template <class T>").how == "model"
    auto = router.route(AUTO, "EVP_MD_CTX *mdctx = EVP_MD_CTX_new();")
    assert (auto.name, auto.how) == ("crypto", "auto") and auto.confidence > 0.5
    assert router.route(AUTO, "/* nothing */").how == "default"
    with pytest.raises(UnknownModel, match="stl, crypto, auto"):
        router.route("gpt-4", "x")
    with pytest.raises(MegaCppError, match="router model"):
        Router(["stl", "crypto"]).route(AUTO, "x")
    assert Router(["only"]).route(AUTO, "x").name == "only"
    with pytest.raises(MegaCppError, match="not loaded specialists"):
        Router(["stl", "other"], clf)


def test_train_router_on_real_headers_holds_out_whole_files(tmp_path):
    bits = Path("/usr/include/c++/12/bits")
    if not bits.is_dir():
        pytest.skip("needs the libstdc++ headers")
    stl = tmp_path / "stl"
    stl.mkdir()
    for p in sorted(bits.glob("stl_*.h"))[:12]:
        (stl / p.name).write_text(p.read_text())
    crypto = tmp_path / "crypto"
    crypto.mkdir()
    for i in range(40):  # a second source in another style, many files
        (crypto / f"f{i}.c").write_text("\n".join(CRYPTO[(i + j) % 3] for j in range(12)))
    x, _y, hx, hy = labelled_snippets({"a": ["l1\nl2\nl3"] * 30}, 2, heldout_permille=1000)
    assert not x and len(hx) == 60 and set(hy) == {"a"}
    clf = train_router({"stl": stl, "crypto": crypto}, snippet_lines=20)
    assert clf.meta["snippets"]["stl"] > 50 and clf.meta["heldout_snippets"] > 0
    assert clf.meta["heldout_accuracy"] > 0.9
    (tmp_path / "empty").mkdir()
    with pytest.raises(MegaCppError, match="no C/C.. text"):
        train_router({"stl": stl, "empty": (tmp_path / "empty").resolve()})


def test_server_routes_by_model_and_by_classifier(clf):
    specialists = [tiny_specialist("stl", seed=0), tiny_specialist("crypto", seed=1)]
    with live_server(specialists, clf) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        ids = [m["id"] for m in c.get("/v1/models").json()["data"]]
        assert ids == ["stl", "crypto", AUTO]
        for model, prompt, expected, how in [
            ("crypto", STL[0], "crypto", "model"),
            (AUTO, "EVP_CIPHER_CTX *ctx = EVP_CIPHER_CTX_new();\n", "crypto", "auto"),
            (AUTO, "template <typename _Tp>\n", "stl", "auto"),
        ]:
            r = c.post("/v1/completions", json={"model": model, "prompt": prompt,
                                                "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == expected and r.headers["x-megacpp-specialist"] == expected
            assert r.headers["x-megacpp-route"] == how
        chat = c.post("/v1/chat/completions", json={"model": AUTO, "max_tokens": 2, "messages": [
            {"role": "user", "content": "Fix this:\nBIGNUM *bn = BN_new(); BN_free(bn);"}]})
        assert chat.json()["model"] == "crypto"
        # the two specialists really are different models: same seed, different samples
        outs = {name: c.post("/v1/completions", json={
            "model": name, "prompt": "int main() {", "max_tokens": 8, "temperature": 1, "seed": 0,
        }).json()["choices"][0]["text"] for name in ("stl", "crypto")}
        assert outs["stl"] != outs["crypto"]
