"""``megacpp model translate`` end to end, as a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "megacpp", "model", "translate", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_translate_prints_pattern_flags_and_notes():
    out = run_cli("--to", "megatron", "(AEMD)x3 | AEMD | AEMD", "--num-experts", "8")
    assert out.returncode == 0, out.stderr
    assert "*EM-*EM-*EM-*EM-*EM-" in out.stdout
    assert (
        "--hybrid-override-pattern '*EM-*EM-*EM-*EM-*EM-' --num-layers 20 "
        "--pipeline-model-parallel-size 3 --decoder-first-pipeline-num-layers 12 "
        "--num-experts 8"
    ) in out.stdout
    assert "Mamba-2" in out.stdout and "megatron-core 0.16.1" in out.stdout


def test_translate_json():
    out = run_cli("--to", "megatron", "--json", "A E M E")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["hybrid_override_pattern"] == "*EME"
    assert data["num_layers"] == 4
    assert data["stage_sizes"] == [4]
    assert data["argv"] == ["--hybrid-override-pattern", "*EME", "--num-layers", "4"]
    assert data["missing"] == ["--num-experts"]
    assert data["megatron_core_verified"] == "0.16.1"
    assert data["config"]["TransformerConfig"] == {"num_layers": 4}


@pytest.mark.parametrize(
    "args,message",
    [
        (["NAM56R"], "error: layer 11 'R' has no verified Megatron-Core mapping"),
        (["AE A:mla"], "error: layer 2 'A:mla' has no verified Megatron-Core mapping"),
        (["M:mimo"], "error: layer 0 'M:mimo' has no verified Megatron-Core mapping"),
        (["AEMQ"], "error: unknown layer letter 'Q' at 3 in 'AEMQ'"),
        (["A|AA|AAA|AAAA"], "error: pipeline stage sizes [1, 2, 3, 4] cannot be expressed"),
        (["AMD", "--num-experts", "4"], "error: --num-experts was given but the pattern has no E"),
    ],
)
def test_translate_fails_closed_with_one_line(args, message):
    out = run_cli("--to", "megatron", *args)
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr.startswith(message)
    assert len(out.stderr.strip().splitlines()) == 1
    assert "Traceback" not in out.stderr


def test_unknown_target_fails_closed():
    out = run_cli("--to", "vllm", "AEME")
    assert out.returncode == 2
    assert out.stderr.strip() == "error: unknown translation target 'vllm'; allowed: megatron"
