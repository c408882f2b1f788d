"""verify-site on a real pip install that is then edited, pruned and extended in place."""

from __future__ import annotations

from pathlib import Path

import pytest

from megacpp.contract import verify_site
from megacpp.contract.integrity import describe_problems
from megacpp.errors import MegaCppError


def _report(site: Path):
    (report,) = verify_site(["tabulate"], path=site)
    return report


def test_a_fresh_install_verifies(installed_site: Path):
    report = _report(installed_site)
    assert report.ok, describe_problems(report)
    assert report.name == "tabulate" and report.version == "0.10.0"
    assert report.checked >= 5 and report.unhashed >= 1  # RECORD itself (and any .pyc)


def test_modified_missing_and_unexpected_files_are_reported(installed_site: Path):
    module = installed_site / "tabulate" / "__init__.py"
    text = module.read_text()
    module.write_text(text.replace("def ", "def_", 1))  # same size: only the hash can tell
    assert module.stat().st_size == len(text.encode())
    (installed_site / "tabulate-0.10.0.dist-info" / "top_level.txt").unlink()
    record = (installed_site / "tabulate-0.10.0.dist-info" / "RECORD").read_text()
    (script_row,) = [line.split(",")[0] for line in record.splitlines() if line.startswith("..")]
    script = installed_site / script_row  # the console script, outside site-packages
    script.write_text(script.read_text() + "# patched\n")
    (installed_site / "tabulate" / "hotfix.py").write_text("PATCHED = True\n")
    cache = installed_site / "tabulate" / "__pycache__"
    cache.mkdir(exist_ok=True)
    (cache / "stray.cpython-311.pyc").write_bytes(b"ignored")

    report = _report(installed_site)
    assert not report.ok
    assert script_row.endswith("bin/tabulate")
    assert sorted(report.modified) == sorted([script_row, "tabulate/__init__.py"])
    assert report.missing == ["tabulate-0.10.0.dist-info/top_level.txt"]
    assert report.unexpected == ["tabulate/hotfix.py"]
    assert "modified: " in describe_problems(report)


def test_weak_or_unknown_hashes_are_unverifiable(installed_site: Path):
    record = installed_site / "tabulate-0.10.0.dist-info" / "RECORD"
    record.write_text(record.read_text() + "tabulate/extra.txt,md5=abc,3\n")
    (installed_site / "tabulate" / "extra.txt").write_text("abc")
    report = _report(installed_site)
    assert report.unverifiable == ["tabulate/extra.txt (hash md5)"] and not report.ok


def test_distribution_without_record_cannot_be_verified(installed_site: Path):
    (installed_site / "tabulate-0.10.0.dist-info" / "RECORD").unlink()
    report = _report(installed_site)
    assert not report.ok and "no RECORD" in report.error


def test_bad_names_and_paths_fail_clearly(installed_site: Path, tmp_path: Path):
    with pytest.raises(MegaCppError, match="not installed in .*: no-such-dist"):
        verify_site(["tabulate", "no-such-dist"], path=installed_site)
    assert [
        r.name
        for r in verify_site(["tabulate", "no-such-dist"], path=installed_site, installed_only=True)
    ] == ["tabulate"]
    with pytest.raises(MegaCppError, match="is not a directory"):
        verify_site(path=tmp_path / "missing")


def test_installed_packages_of_this_environment_verify():
    (report,) = verify_site(["tokenizers"])
    assert report.ok, describe_problems(report)
