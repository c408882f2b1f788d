from __future__ import annotations

import json
import subprocess
import sys


def megacpp(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "megacpp", *args], capture_output=True,
                          check=False, text=True)


def test_describe_nam56r_json_totals_add_up():
    out = megacpp(
        "model", "describe", "NAM56R", "--config", "nam56r-small", "--json", "--seq-len", "4096"
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert len(data["layers"]) == 56 and data["seq_len"] == 4096
    t = data["totals"]
    assert t["params"] > t["active_params"] > 0
    assert t["fwd_flops_per_token"] > sum(layer["fwd_flops_per_token"] for layer in data["layers"])
    assert t["train_flops_per_token"] == 3 * t["fwd_flops_per_token"]


def test_describe_table_shows_every_layer():
    out = megacpp("model", "describe", "AEMR|DM:mimo", "--config", "tiny")
    assert out.returncode == 0, out.stderr
    for needle in ("embedding", "lm_head (tied)", "A", "E", "M", "M:mimo", "R", "D", "MFLOP/tok"):
        assert needle in out.stdout


def test_describe_bad_input_is_one_line_exit_2():
    for args, needle in [
        (("AEXM",), "unknown"),
        (("AEM", "--config", "nope"), "unknown preset 'nope'"),
        (("AEM", "--seq-len", "0"), "--seq-len must be positive"),
    ]:
        out = megacpp("model", "describe", *args)
        assert out.returncode == 2, (args, out.stderr)
        assert needle in out.stderr and "Traceback" not in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_describe_counts_the_structure_and_ngram_tables(tmp_path):
    config = tmp_path / "features.toml"
    config.write_text('[model]\npattern = "AEMR"\nd_model = 64\nvocab_size = 1000\n'
                      '[structure]\nembedding = true\n'
                      '[ngram]\norders = [2, 3]\ntable_size = 4096\n')
    table = megacpp("model", "describe", "AEMR", "--config", str(config))
    assert table.returncode == 0, table.stderr
    assert "structure embedding" in table.stdout and "n-gram embedding" in table.stdout
    data = json.loads(megacpp("model", "describe", "AEMR", "--config", str(config),
                              "--json").stdout)
    totals = data["totals"]
    assert totals["structure_params"] == 9 * 64 and totals["ngram_params"] == 2 * 4096 * 64
    plain = json.loads(megacpp("model", "describe", "AEMR", "--config", "tiny", "--json",
                               ).stdout)["totals"]
    assert plain["structure_params"] == plain["ngram_params"] == 0


def test_describe_dsa_index_cache_config(tmp_path):
    """``[dsa] index_from``: reusing layers are counted without an indexer; a bad list, or a
    pattern argument whose DSA layers the list does not fit, is one error line, exit 2."""
    def config(index_from: str) -> str:
        path = tmp_path / f"dsa{len(list(tmp_path.iterdir()))}.toml"
        path.write_text('[model]\npattern = "A:dsa E A:dsa E"\nd_model = 64\nvocab_size = 1000\n'
                        '[mla]\nn_heads = 4\nq_lora_rank = 32\nkv_lora_rank = 32\n'
                        'qk_nope_head_dim = 16\nqk_rope_head_dim = 16\nv_head_dim = 16\n'
                        f'[dsa]\nindex_n_heads = 2\nindex_head_dim = 16\nindex_from = {index_from}\n')
        return str(path)

    shared = json.loads(megacpp("model", "describe", "--config", config("[-1, 0]"),
                                "--json").stdout)["layers"]
    own = json.loads(megacpp("model", "describe", "--config", config("[]"), "--json").stdout)
    assert shared[2]["params"] < own["layers"][2]["params"] == shared[0]["params"]
    assert shared[2]["cache_bytes_per_token"] < shared[0]["cache_bytes_per_token"]
    for args, needle in [
        (("--config", config("[-1, 1]")), "dsa.index_from = [-1, 1] is invalid"),
        (("A:dsa E A:dsa E A:dsa", "--config", config("[-1, 0]")), "dsa.index_from has 2"),
    ]:
        out = megacpp("model", "describe", *args)
        assert out.returncode == 2, (args, out.stderr)
        assert needle in out.stderr and "Traceback" not in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
