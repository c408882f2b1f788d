"""Shared by the trainer tests: a real tiny C++ dataset, tiny run configs, subprocess runs.

(Imported as ``tests.train.helpers``: pyproject puts the repo root on pytest's path.)
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from megacpp.train.config import to_toml


def _libstdcxx() -> Path:
    """The newest installed libstdc++ header directory (/usr/include/c++/<version>)."""
    versions = [p for p in Path("/usr/include/c++").glob("*") if (p / "utility").is_file()]
    return max(versions, key=lambda p: int(p.name) if p.name.isdigit() else -1,
               default=Path("/usr/include/c++/12"))


LIBSTDCXX = _libstdcxx()
# Two dozen real libstdc++ headers (about 300 KB of C++).
HEADERS = (
    "utility", "cstddef", "initializer_list", "bits/move.h", "bits/stl_pair.h",
    "bits/stl_function.h", "bits/invoke.h", "bits/ptr_traits.h", "bits/stl_relops.h",
    "bits/std_abs.h", "bits/erase_if.h", "bits/hash_bytes.h", "bits/stl_algobase.h",
    "bits/stl_iterator.h", "bits/stl_vector.h", "bits/stl_list.h", "bits/stl_deque.h",
    "bits/stl_heap.h", "bits/stl_tempbuf.h", "bits/stl_numeric.h", "bits/stl_queue.h",
    "bits/stl_stack.h", "bits/alloc_traits.h", "bits/refwrap.h",
)  # fmt: skip

# The build config: tiny vocabulary, 64-token rows, small shards.
DATA_BUILD = {
    "tokenizer": {"vocab_size": 512, "max_train_bytes": 1 << 20},
    "packing": {"seq_len": 64, "seed": 0, "val_permille": 150, "rows_per_shard": 512,
                "rows_per_group": 16},
}

# A model small enough for a 2-core CPU: every core family (A E M R) at d_model 32.
TINY_MODEL: dict[str, Any] = {
    "preset": "tiny", "vocab_size": "dataset", "d_model": 32, "pattern": "AEMR",
    "attention": {"n_heads": 2, "n_kv_heads": 1, "head_dim": 16},
    "mamba": {"d_state": 16, "headdim": 16, "chunk_size": 16},
    "rnn": {"n_heads": 2, "head_k_dim": 16, "head_v_dim": 16, "chunk_size": 16},
    "moe": {"n_experts": 4, "expert_ffn": 32, "seq_aux_loss_coef": 1e-3},
}

# Overrides of TINY_MODEL: MLA-based DSA attention, an E layer and one MTP module
DSA_MTP_MODEL: dict[str, Any] = {
    "pattern": "A:dsa E",
    "mla": {"n_heads": 2, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
            "v_head_dim": 8},
    "dsa": {"index_n_heads": 2, "index_head_dim": 8, "top_k": 16, "query_chunk": 16},
    "mtp": {"depth": 1, "pattern": "AE"},
}


def single_thread_env() -> dict[str, str]:
    """The environment for subprocess runs: one intra-op thread (the CPU is shared), and
    console lines long enough that messages are not wrapped."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "400"}


def build_dataset(tmp: Path) -> Path:
    """Run the real ``megacpp data build`` on the headers; returns the dataset directory."""
    src = tmp / "src"
    for rel in HEADERS:
        dst = src / rel.replace("/", "_")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(LIBSTDCXX / rel, dst if dst.suffix else dst.with_suffix(".h"))
    config = tmp / "build.toml"
    config.write_text(to_toml(DATA_BUILD))
    out = tmp / "dataset"
    subprocess.run([sys.executable, "-m", "megacpp", "data", "build", str(src), "--out", str(out),
                    "--config", str(config), "--workers", "1"],
                   check=True, capture_output=True, env=single_thread_env(), timeout=300)
    return out


def run_config(dataset: Path, out_dir: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    """A tiny run config (as data); ``sections`` update its tables."""
    config: dict[str, Any] = {
        "run": {"out_dir": str(out_dir), "seed": 0, "check_site_integrity": False,
                "plots": False},
        "model": json.loads(json.dumps(TINY_MODEL)),
        "data": {"dir": str(dataset), "val_batches": 2},
        "train": {"steps": 6, "micro_batch_size": 4, "eval_every": 3},
        "schedule": {"warmup_steps": 2},
        "checkpoint": {"every": 2, "keep_last": 3},
        "guards": {"spike_warmup_steps": 100},
    }
    for table, values in sections.items():
        config.setdefault(table, {}).update(values)
    return config


def write_config(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(to_toml(config))
    return path


def train_losses(run_dir: Path) -> list[float]:
    """The per-step training losses of a run's metrics.jsonl, in step order."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["type"] == "train"]
    assert [r["step"] for r in train] == list(range(1, len(train) + 1))
    return [r["loss"] for r in train]


def megacpp(*args: str, check: bool = True, timeout: float = 300,
            launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run the real CLI (``python -m megacpp``, or under ``launcher``, e.g. torchrun)."""
    cmd = [*launcher, "-m", "megacpp", *args] if launcher else [sys.executable, "-m", "megacpp",
                                                                 *args]
    result = subprocess.run(cmd, capture_output=True, text=True, env=single_thread_env(),
                            timeout=timeout, check=False)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({result.returncode}):\n"
                             f"{result.stdout}\n{result.stderr}")
    return result


TORCHRUN = (sys.executable, "-m", "torch.distributed.run")


def free_port() -> int:
    """A TCP port nothing listens on now (for a rendezvous on 127.0.0.1)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(nproc: int) -> tuple[str, ...]:
    """The launcher of ``nproc`` local processes (gloo on CPU)."""
    return (*TORCHRUN, "--standalone", "--nproc-per-node", str(nproc))
