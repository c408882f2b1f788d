"""``megacpp env ...`` end to end: output, --json, exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from megacpp.cli.env import app
from megacpp.errors import MegaCppError
from tests.contract.evidence_facts import gb10, h100, write_json

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


def test_capture_json_and_out_file(tmp_path: Path):
    out = tmp_path / "fp.json"
    result = invoke("capture", "--json", "--out", str(out), "--packages", "numpy,pyarrow")
    assert result.exit_code == 0, result.output
    written = json.loads(out.read_text())
    assert written["schema"] == "megacpp.fingerprint"
    assert list(written["packages"]) == ["torch", "triton", "numpy", "pyarrow"]
    table = invoke("capture")
    assert table.exit_code == 0 and "environment fingerprint" in table.output


def test_diff_exit_status_follows_contract_drift(tmp_path: Path, cpu_facts):
    a = write_json(tmp_path / "a.json", cpu_facts)
    renamed = {**cpu_facts, "host": {**cpu_facts["host"], "hostname": "other"}}
    b = write_json(tmp_path / "b.json", renamed)
    same = invoke("diff", str(a), str(b))
    assert same.exit_code == 0 and "host.hostname" in same.output
    gpu = write_json(tmp_path / "gpu.json", h100(cpu_facts))
    drift = invoke("diff", str(a), str(gpu), "--json")
    assert drift.exit_code == 1
    data = json.loads(drift.output)
    assert data["contract_breaking"] >= 2
    assert {"accelerator", "devices.count"} <= {
        d["field"] for d in data["differences"] if d["contract"]
    }


def test_preflight_on_injected_gb10_facts(tmp_path: Path, cpu_facts):
    facts = write_json(tmp_path / "gb10.json", gb10(cpu_facts))
    refused = invoke("preflight", "--facts", str(facts), "--kernel", "scan=132KiB", "--json")
    assert refused.exit_code == 1
    report = json.loads(refused.output)
    errors = {f["rule"] for f in report["findings"] if f["severity"] == "error"}
    assert errors == {"kernel-smem", "triton-ptxas-arch"}
    skipped = invoke(
        "preflight",
        "--facts",
        str(facts),
        "--kernel",
        "scan=132KiB",
        "--skip",
        "kernel-smem",
        "--skip",
        "triton-ptxas-arch",
    )
    assert skipped.exit_code == 0 and "skipped" in skipped.output


def test_preflight_on_this_machine_passes(tmp_path: Path):
    config = tmp_path / "c.toml"
    config.write_text('[contract]\npackages = ["tokenizers"]\n')
    result = invoke("preflight", "--config", str(config), "--json")
    assert result.exit_code == 0, result.output
    rules = {f["rule"]: f["severity"] for f in json.loads(result.output)["findings"]}
    assert rules["site-integrity"] == "pass" and "error" not in rules.values()


def test_verify_site_with_path_and_a_tampered_install(installed_site: Path):
    ok = invoke("verify-site", "--path", str(installed_site))
    assert ok.exit_code == 0 and "tabulate" in ok.output
    module = installed_site / "tabulate" / "__init__.py"
    module.write_text(module.read_text() + "# hotfix\n")
    failed = invoke("verify-site", "tabulate", "--path", str(installed_site), "--json")
    assert failed.exit_code == 1
    (report,) = json.loads(failed.output)
    assert report["modified"] == ["tabulate/__init__.py"] and report["ok"] is False


def test_patches_and_mfu_commands(tmp_path: Path, cpu_facts):
    facts = write_json(tmp_path / "gb10.json", gb10(cpu_facts))
    listing = json.loads(invoke("patches", "--facts", str(facts), "--json").output)
    assert {row["name"]: row["applies"] for row in listing} == {
        "triton-system-ptxas": True,
        "inductor-big-gpu": True,
    }
    na = invoke("mfu", "--flops-per-token", "6e9", "--tokens-per-s", "5000", "--facts", str(facts))
    assert na.exit_code == 0 and "n/a" in na.output
    h100_mfu = invoke(
        "mfu",
        "--flops-per-token",
        "6e9",
        "--tokens-per-s",
        "50000",
        "--device",
        "h100-sxm",
        "--json",
    )
    assert abs(json.loads(h100_mfu.output)["mfu"] - 300 / 989.4) < 1e-9
    devices = invoke("devices", "--json")
    assert {"gb10", "h100-sxm", "cpu"} <= {d["key"] for d in json.loads(devices.output)}


def test_bad_input_is_a_user_error_not_a_crash(tmp_path: Path):
    broken = tmp_path / "broken.json"
    broken.write_text('{"schema": "megacpp.fingerprint", "host": {')
    result = invoke("diff", str(broken), str(broken))
    assert isinstance(result.exception, MegaCppError) and "not valid JSON" in str(result.exception)
    bad_kernel = invoke("preflight", "--kernel", "oops", "--no-integrity")
    assert isinstance(bad_kernel.exception, MegaCppError)


def test_console_script_prints_one_line_errors(tmp_path: Path, cpu_facts):
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    done = subprocess.run(
        [sys.executable, "-m", "megacpp", "env", "diff", str(broken), str(broken)],
        capture_output=True, check=False,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("error:") and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) <= 2  # one message (rich may wrap it once)


def test_console_script_exit_status_for_drift_has_no_traceback(tmp_path: Path, cpu_facts):
    a = write_json(tmp_path / "a.json", cpu_facts)
    gpu = write_json(tmp_path / "gpu.json", h100(cpu_facts))
    done = subprocess.run(
        [sys.executable, "-m", "megacpp", "env", "diff", str(a), str(gpu)],
        capture_output=True, check=False,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "contract-breaking" in done.stdout
    assert "Traceback" not in done.stderr


def test_diff_accepts_receipts_as_well_as_fingerprints(tmp_path: Path, cpu_facts):
    from megacpp.receipts import write_receipt

    receipt = tmp_path / "r.json"
    write_receipt(receipt, "bench", {"b": 1}, {"tokens_per_s": 1.0}, fingerprint=cpu_facts)
    fingerprint = write_json(tmp_path / "fp.json", cpu_facts)
    result = invoke("diff", str(receipt), str(fingerprint), "--json")
    assert result.exit_code == 0 and json.loads(result.output)["differences"] == []
