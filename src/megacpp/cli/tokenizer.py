"""``megacpp tokenizer ...``: train, compare, inspect and try the C++ tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from megacpp._io import TEXT_LIMIT, read_text_bounded
from megacpp.cli._options import DATA_BUILD_CONFIG_HELP, utf8_text
from megacpp.data.build import BuildConfig, curate_documents, plan_documents
from megacpp.data.packing import TRAIN, VALIDATION
from megacpp.data.tokenizer import (
    SPECIAL_TOKENS,
    CppTokenizer,
    bytes_per_token,
    compare_with_plain_bpe,
    iter_capped,
    reserved_strings,
    train_tokenizer,
)
from megacpp.errors import MegaCppError

app = typer.Typer(add_completion=False, no_args_is_help=True)

_Sources = Annotated[list[Path], typer.Argument(help="Source directories or files.")]
_Config = Annotated[
    Path | None, typer.Option("--config", help=DATA_BUILD_CONFIG_HELP)
]


def _curated_splits(
    sources: list[Path], cfg: BuildConfig, val_permille: int | None
) -> tuple[list[str], list[str]]:
    """Texts of the curated train and held-out documents (train capped at max_train_bytes)."""
    if val_permille is not None:
        cfg.packing.val_permille = val_permille
        cfg.packing.validate()
    with _spinner() as progress:
        docs, _ = curate_documents(sources, cfg.corpus, progress)
    planned, _ = plan_documents(docs, cfg.packing)
    train = list(
        iter_capped(
            (p.doc.text for p in planned if p.split == TRAIN), cfg.tokenizer.max_train_bytes
        )
    )
    heldout = [p.doc.text for p in planned if p.split == VALIDATION]
    if not train:
        raise MegaCppError(f"no training documents after curation of {len(docs)} kept document(s)")
    return train, heldout


def _spinner() -> Progress:
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
    )


@app.command()
def train(
    sources: _Sources,
    out: Annotated[Path, typer.Option("--out", help="Where to write tokenizer.json.")],
    vocab_size: Annotated[
        int | None, typer.Option(help="Vocabulary size (default: config or 32768).")
    ] = None,
    config: _Config = None,
) -> None:
    """Train the byte-level BPE C++ tokenizer on the curated train split of SOURCES."""
    cfg = BuildConfig.from_toml(config) if config else BuildConfig()
    if vocab_size is not None:
        cfg.tokenizer.vocab_size = vocab_size
        cfg.tokenizer.validate()
    train_texts, heldout = _curated_splits(sources, cfg, None)
    with _spinner() as progress:
        progress.add_task(
            f"training (vocab {cfg.tokenizer.vocab_size}, {len(train_texts)} documents)", total=None
        )
        hf = train_tokenizer(
            train_texts,
            cfg.tokenizer.vocab_size,
            min_frequency=cfg.tokenizer.min_frequency,
            reserve=cfg.tokenizer.reserve,
        )
    tok = CppTokenizer.from_hf(hf)
    tok.save(out)
    typer.echo(f"wrote {out} (vocab {tok.vocab_size}, sha256 {CppTokenizer.load(out).sha256})")
    if heldout:
        typer.echo(
            f"held-out bytes/token: {bytes_per_token(hf, heldout):.3f} ({len(heldout)} documents)"
        )


@app.command()
def compare(
    sources: _Sources,
    vocab_size: Annotated[int, typer.Option(help="Vocabulary size of both tokenizers.")] = 32768,
    val_permille: Annotated[
        int, typer.Option(help="Held-out share of documents, per mille (by content hash).")
    ] = 100,
    config: _Config = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")] = False,
) -> None:
    """Bytes per token on held-out documents: megacpp's tokenizer vs a stock byte-level BPE
    trained on the same documents with the same vocabulary size."""
    cfg = BuildConfig.from_toml(config) if config else BuildConfig()
    train_texts, heldout = _curated_splits(sources, cfg, val_permille)
    if not heldout:
        raise MegaCppError(f"no held-out documents at --val-permille {val_permille}; raise it")
    with _spinner() as progress:
        progress.add_task("training both tokenizers", total=None)
        result = compare_with_plain_bpe(
            train_texts, heldout, vocab_size, min_frequency=cfg.tokenizer.min_frequency
        )
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    table = Table(
        title=f"Bytes per token, held-out ({result['heldout_documents']} documents, "
        f"{result['heldout_bytes'] / 1e6:.2f} MB)"
    )
    table.add_column("tokenizer")
    table.add_column(f"vocab {vocab_size}", justify="right")
    table.add_row(
        "megacpp (code pre-tokenizer + reserved C++ vocab)",
        f"{result['megacpp_bytes_per_token']:.3f}",
    )
    table.add_row(
        "plain byte-level BPE (GPT-2 pre-tokenizer)", f"{result['plain_bpe_bytes_per_token']:.3f}"
    )
    Console(highlight=False).print(table)


@app.command()
def info(path: Annotated[Path, typer.Argument(help="A megacpp tokenizer.json.")]) -> None:
    """Vocabulary size, special token ids, hash, and reserved-vocabulary coverage."""
    tok = CppTokenizer.load(path)
    single = sum(len(tok.encode(w)) == 1 for w in reserved_strings())
    typer.echo(f"{path}: vocab {tok.vocab_size}, sha256 {tok.sha256}")
    typer.echo(
        "special tokens: " + ", ".join(f"{t}={tok.hf.token_to_id(t)}" for t in SPECIAL_TOKENS)
    )
    typer.echo(f"reserved C++ strings that are single tokens: {single}/{len(reserved_strings())}")


@app.command()
def encode(
    path: Annotated[Path, typer.Argument(help="A megacpp tokenizer.json.")],
    text: Annotated[str | None, typer.Argument(help="Text to encode.")] = None,
    file: Annotated[Path | None, typer.Option("--file", help="Encode this file instead.")] = None,
) -> None:
    """Show the tokens of TEXT (or --file): id and piece per token."""
    if (text is None) == (file is None):
        raise MegaCppError("give either TEXT or --file (exactly one)")
    if file is not None:
        text = read_text_bounded(file, TEXT_LIMIT, what="--file")
    text = utf8_text(text, "TEXT")
    tok = CppTokenizer.load(path)
    ids = tok.encode(text)
    for i in ids.tolist():
        typer.echo(f"{i:>7}  {tok.decode([i], skip_special_tokens=False)!r}")
    typer.echo(f"{len(ids)} tokens, {len(text.encode('utf-8')) / max(len(ids), 1):.2f} bytes/token")
