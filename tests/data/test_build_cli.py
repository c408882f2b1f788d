"""``megacpp data ...`` and ``megacpp tokenizer ...`` end to end: the build config, the CLI
commands, clean one-line errors, and crash safety (SIGKILL mid-build, then rerun)."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from megacpp import configs
from megacpp._io import sha256_file
from megacpp.cli.main import main
from megacpp.data.build import BuildConfig, build_dataset
from megacpp.data.megatron import iter_documents
from megacpp.data.shards import MARKER, ShardedDataset
from megacpp.errors import ConfigError, MegaCppError
from tests.data.packed_fixtures import tiny_config_dict, write_corpus

REPO = Path(__file__).resolve().parents[2]
MEGACPP = [sys.executable, "-m", "megacpp.cli.main"]


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    """Run the CLI in-process; returns (exit code, stdout, stderr)."""
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


def run_cli_subprocess(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [*MEGACPP, *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=240,
        check=False,
        **kwargs,
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("cli") / "src")


@pytest.fixture(scope="module")
def config_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "build.toml"
    cfg = tiny_config_dict()
    lines = []
    for table, values in cfg.items():
        lines.append(f"[{table}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    lines += ["[corpus]", "min_bytes = 16"]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory, corpus, config_file) -> Path:
    out = tmp_path_factory.mktemp("built") / "ds"
    build_dataset([corpus], out, BuildConfig.from_toml(config_file), workers=1)
    return out


# ---- config --------------------------------------------------------------------------------


def test_shipped_configs_parse_by_name():
    names = configs.names("data")
    assert {"cpp", "tiny"} <= set(names)
    for name in names:
        cfg = BuildConfig.from_toml(name)
        assert BuildConfig.from_dict(cfg.to_dict()) == cfg
    assert BuildConfig.from_toml("tiny").packing.seq_len == 256
    with pytest.raises(ConfigError, match="unknown data build config 'nope'; shipped: cpp, quality, tiny"):
        BuildConfig.from_toml("nope")


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError,
                       match=r"unknown key\(s\) \['pakking'\] in the build config; allowed"):
        BuildConfig.from_dict({"pakking": {}})
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['seqlen'\] in \[packing\]; allowed"):
        BuildConfig.from_dict({"packing": {"seqlen": 5}})
    with pytest.raises(ConfigError, match=r"packing.seq_len = '5': expected an integer"):
        BuildConfig.from_dict({"packing": {"seq_len": "5"}})
    with pytest.raises(ConfigError, match=r"packing.val_permille: expected an integer in 0..1000"):
        BuildConfig.from_dict({"packing": {"val_permille": 1001}})
    with pytest.raises(ConfigError, match=r"tokenizer.vocab_size: expected an integer in 264\.\."):
        BuildConfig.from_dict({"tokenizer": {"vocab_size": 10}})
    with pytest.raises(ConfigError, match=r"packing.seq_len: expected an integer in 1\.\."):
        BuildConfig.from_dict({"packing": {"seq_len": 10**12}})
    with pytest.raises(ConfigError, match=r"packing.seed = 9{23}: expected an integer"):
        BuildConfig.from_dict({"packing": {"seed": 99999999999999999999999}})
    with pytest.raises(ConfigError, match=r"structure.timeout_s"):
        BuildConfig.from_dict({"structure": {"timeout_s": 0}})
    with pytest.raises(ConfigError, match="corpus"):
        BuildConfig.from_dict({"corpus": {"no_such_knob": 1}})
    bad = tmp_path / "bad.toml"
    bad.write_text("[packing\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        BuildConfig.from_toml(bad)


# ---- the commands --------------------------------------------------------------------------


def test_data_build_cli(corpus, config_file, tmp_path, capsys):
    out = tmp_path / "ds"
    code, stdout, _ = run_cli(
        ["data", "build", corpus, "--out", out, "--config", config_file, "--workers", "1"], capsys
    )
    assert code == 0, stdout
    assert "Stages" in stdout and "near_dedup" in stdout and "dataset written to" in stdout
    ds = ShardedDataset.open(out)
    assert ds.manifest["config"]["corpus"]["min_bytes"] == 16

    code, _, err = run_cli(["data", "build", corpus, "--out", out, "--config", config_file], capsys)
    assert code == 2 and "already holds a complete dataset; pass --overwrite" in err

    tok = out / "tokenizer.json"
    code, _, err = run_cli(
        [
            "data",
            "build",
            corpus,
            "--out",
            out,
            "--config",
            config_file,
            "--tokenizer",
            tok,
            "--overwrite",
            "--workers",
            "2",
        ],
        capsys,
    )
    assert code == 0, err
    rebuilt = ShardedDataset.open(out)
    assert rebuilt.manifest["tokenizer"]["sha256"] == ds.manifest["tokenizer"]["sha256"]
    assert rebuilt.manifest["splits"] == ds.manifest["splits"]  # same shards, 2 workers


def test_data_stats_cli(built, tmp_path, capsys):
    png = tmp_path / "lengths.png"
    code, stdout, err = run_cli(["data", "stats", built, "--png", png], capsys)
    assert code == 0, err
    for word in ("Stages", "Splits", "Licenses", "exact_duplicate", "near_duplicate"):
        assert word in stdout
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size[0] > 400
    code, stdout, _ = run_cli(["data", "stats", built, "--png", png, "--json"], capsys)
    summary = json.loads(stdout)
    assert summary["splits"]["train"]["documents"] > 0
    assert sum(summary["licenses"].values()) == sum(
        s["documents"] for s in summary["splits"].values()
    )


def test_export_megatron_and_verify_cli(built, tmp_path, capsys):
    code, stdout, err = run_cli(["data", "export-megatron", built, "--out", tmp_path / "m"], capsys)
    assert code == 0, err
    assert (tmp_path / "m_train.bin").stat().st_size > 0 and (tmp_path / "m_train.idx").is_file()
    code, stdout, _ = run_cli(["data", "verify", built], capsys)
    assert code == 0 and stdout.startswith("ok:")


def test_tokenizer_cli(corpus, config_file, tmp_path, capsys):
    tok = tmp_path / "tok.json"
    code, stdout, err = run_cli(
        [
            "tokenizer",
            "train",
            corpus,
            "--out",
            tok,
            "--vocab-size",
            "400",
            "--config",
            config_file,
        ],
        capsys,
    )
    assert code == 0, err
    assert "vocab 400" in stdout
    code, stdout, _ = run_cli(["tokenizer", "info", tok], capsys)
    assert code == 0 and "<|bos|>=1" in stdout and "reserved C++ strings" in stdout
    code, stdout, _ = run_cli(["tokenizer", "encode", tok, "int main() { return 0; }"], capsys)
    assert code == 0 and "'int'" in stdout and "' return'" in stdout and "tokens," in stdout
    code, stdout, err = run_cli(
        ["tokenizer", "compare", corpus, "--vocab-size", "400", "--val-permille", "400", "--json"],
        capsys,
    )
    assert code == 0, err
    result = json.loads(stdout)
    assert result["megacpp_bytes_per_token"] > 1 and result["plain_bpe_bytes_per_token"] > 1


# ---- bad input: one line on stderr, exit 2, nothing lost ------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["data", "build", "/no/such/dir", "--out", "{tmp}/o"], "does not exist"),
        (["data", "stats", "{tmp}"], "has no _COMPLETE marker"),
        (["data", "verify", "{tmp}/none"], "no dataset at"),
        (["tokenizer", "info", "{tmp}/none.json"], "tokenizer {tmp}/none.json does not exist"),
        (
            ["data", "build", "{tmp}", "--out", "{tmp}/o", "--tokenizer", "{tmp}/t.json"],
            "tokenizer {tmp}/t.json does not exist",
        ),
        (["tokenizer", "encode", "{tmp}/none.json"], "give either TEXT or --file"),
    ],
)
def test_bad_input_is_one_line(args, message, tmp_path, capsys):
    code, _, err = run_cli([a.replace("{tmp}", str(tmp_path)) for a in args], capsys)
    assert code == 2
    assert message.replace("{tmp}", str(tmp_path)) in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_refuses_to_replace_a_foreign_directory(corpus, config_file, tmp_path, capsys):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    code, _, err = run_cli(
        ["data", "build", corpus, "--out", out, "--config", config_file, "--overwrite"], capsys
    )
    assert code == 2 and "is not a megacpp dataset" in err
    assert (out / "notes.txt").read_text() == "keep me"


def _flip_byte(root: Path) -> str:
    shard = min((root / "train").glob("*.parquet"))
    data = bytearray(shard.read_bytes())
    data[-20] ^= 0xFF
    shard.write_bytes(bytes(data))
    return f"{shard.name} is corrupt"


def _truncate(root: Path) -> str:
    shard = max((root / "train").glob("*.parquet"))
    shard.write_bytes(shard.read_bytes()[:-1])
    return f"{shard.name} is corrupt"


def _drop_marker(root: Path) -> str:
    (root / MARKER).unlink()
    return "has no _COMPLETE marker"


def _future_schema(root: Path) -> str:
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["schema_version"] += 1
    (root / "manifest.json").write_text(json.dumps(manifest))
    (root / MARKER).write_text(sha256_file(root / "manifest.json"))
    return "uses shard schema version 2; this megacpp reads version 1"


@pytest.mark.parametrize("damage", [_flip_byte, _truncate, _drop_marker, _future_schema])
@pytest.mark.parametrize("command", ["verify", "stats", "export-megatron"])
def test_damaged_dataset_is_refused_in_one_line(built, tmp_path, capsys, damage, command):
    import shutil

    copy = Path(shutil.copytree(built, tmp_path / "copy"))
    expected = damage(copy)
    extra = {
        "verify": [],
        "stats": ["--png", tmp_path / "x.png"],
        "export-megatron": ["--out", tmp_path / "m"],
    }[command]
    code, _, err = run_cli(["data", command, copy, *extra], capsys)
    assert code == 2
    assert expected in err and len(err.strip().splitlines()) == 1


def test_corrupt_shard_cli_subprocess(built, tmp_path):
    import shutil

    copy = Path(shutil.copytree(built, tmp_path / "copy"))
    shard = min((copy / "train").glob("*.parquet"))
    data = bytearray(shard.read_bytes())
    data[-20] ^= 0xFF
    shard.write_bytes(bytes(data))
    proc = run_cli_subprocess(["data", "verify", copy])
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert f"{shard.name} is corrupt" in proc.stderr


def test_build_over_hostile_tree(hostile_corpus, tmp_path):
    """Curation drops what it must (counted), the build keeps going, and every kept document
    comes back out of the shards byte for byte."""
    config = tiny_config_dict(val_permille=0)
    config["corpus"] = {"max_bytes": 64 * 1024}
    out = tmp_path / "ds"
    build_dataset([hostile_corpus.root], out, BuildConfig.from_dict(config), workers=1)
    ds = ShardedDataset.open(out)
    docs = {d["rel_path"]: d for d in ds.documents().to_pylist()}
    assert set(docs) == hostile_corpus.kept
    dropped = Counter()
    for stage in ds.manifest["stages"]:
        dropped.update(stage["dropped"])
    assert Counter(hostile_corpus.drops.values()) <= dropped
    tok = ds.tokenizer()
    by_index = {d["doc_index"]: d for d in docs.values()}
    for doc_index, tokens in iter_documents(ds, "train"):
        doc = by_index.pop(doc_index)
        assert tok.decode(tokens) == doc["text"]
        raw = (Path(doc["source_root"]) / doc["rel_path"]).read_bytes()
        assert raw.removeprefix(b"\xef\xbb\xbf") == doc["text"].encode("utf-8")
    assert by_index == {}


# ---- crash safety ---------------------------------------------------------------------------


def _wait_for_lock_release(lock_path, timeout: float = 30.0) -> None:
    """Until no killed process holds the build lock. The group's SIGKILL is asynchronous: a
    rerun right after reaping the main process once found the lock still held (in CI;
    presumably a worker being spawned, which shares the open lock file between fork and exec,
    not yet gone). A lock held past ``timeout`` fails the test."""
    deadline = time.monotonic() + timeout
    with open(lock_path) as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                assert time.monotonic() < deadline, "the killed build still holds its lock"
                time.sleep(0.01)
                continue
            fcntl.flock(lock, fcntl.LOCK_UN)
            return


def test_sigkill_mid_build_then_rerun(tmp_path, corpus, config_file):
    sources = [corpus]
    out = tmp_path / "ds"
    staging = tmp_path / ".ds.partial"
    proc = subprocess.Popen(
        [
            *MEGACPP,
            "data",
            "build",
            *map(str, sources),
            "--out",
            str(out),
            "--config",
            str(config_file),
            "--workers",
            "2",
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: the kill takes the workers too
    )
    deadline = time.monotonic() + 120
    while not (staging / "documents.parquet").exists():  # curated, tokenizer trained
        assert proc.poll() is None, "build finished before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    _wait_for_lock_release(tmp_path / ".ds.lock")
    assert not out.exists() and staging.exists()
    with pytest.raises(MegaCppError, match="no dataset at"):
        ShardedDataset.open(out)

    cfg = BuildConfig.from_toml(config_file)
    build_dataset(sources, out, cfg, workers=1)
    ds = ShardedDataset.open(out)
    assert (out / MARKER).is_file() and not staging.exists()
    assert ds.num_rows("train") > 0


def test_build_config_toml_matches_manifest(built, config_file):
    manifest_cfg = ShardedDataset.open(built, verify=False).manifest["config"]
    assert manifest_cfg["packing"] == tomllib.loads(config_file.read_text())["packing"]
