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
