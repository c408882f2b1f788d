"""``megacpp data ...``: build, verify, inspect and export packed C/C++ corpora."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from megacpp.cli._options import DATA_BUILD_CONFIG_HELP
from megacpp.data.build import BuildConfig, build_dataset
from megacpp.data.megatron import export_megatron
from megacpp.data.shards import ShardedDataset
from megacpp.data.stats import DatasetStats, dataset_stats, plot_doc_lengths

app = typer.Typer(add_completion=False, no_args_is_help=True)


@app.command()
def build(
    sources: Annotated[list[Path], typer.Argument(
        help="Source directories or files; .parquet / .jsonl[.gz|.zst] files are document "
             "tables (a content column, optional path, repo, license).")],
    out: Annotated[Path, typer.Option("--out", help="Dataset directory to create.")],
    config: Annotated[
        Path | None, typer.Option("--config", help=DATA_BUILD_CONFIG_HELP)
    ] = None,
    tokenizer: Annotated[
        Path | None,
        typer.Option("--tokenizer", help="Use this tokenizer.json instead of training one."),
    ] = None,
    workers: Annotated[
        int | None, typer.Option(help="Processes for tokenize + structure (default: CPUs).")
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace an existing dataset at --out.")
    ] = False,
) -> None:
    """Curate SOURCES, train (or load) the tokenizer, label structure, pack into shards."""
    cfg = BuildConfig.from_toml(config) if config else BuildConfig()
    console = Console(stderr=True)
    result = build_dataset(
        sources,
        out,
        cfg,
        tokenizer_path=tokenizer,
        workers=workers,
        overwrite=overwrite,
        console=console,
    )
    out_console = Console(highlight=False)
    _print_stages(out_console, result.manifest["stages"])
    out_console.print(_splits_table(result.manifest["splits"]))
    out_console.print(f"dataset written to [bold]{result.out}[/]")


@app.command()
def verify(dataset: Annotated[Path, typer.Argument(help="Dataset directory.")]) -> None:
    """Check the completion marker, manifest, schema version and every file's sha256."""
    ds = ShardedDataset.open(dataset, verify=True)
    n_files = sum(len(ds.shards(s)) for s in ds.manifest["splits"]) + 2
    typer.echo(f"ok: {dataset} ({n_files} files verified, manifest {ds.manifest_sha256[:16]})")


@app.command()
def stats(
    dataset: Annotated[Path, typer.Argument(help="Dataset directory.")],
    png: Annotated[
        Path | None,
        typer.Option(
            "--png",
            help="Where to write the length histogram "
            "(default: DATASET/../<name>-doc-lengths.png).",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")] = False,
) -> None:
    """Stage counts and drop reasons, license mix, dedup rates, tokens, length histogram."""
    ds = ShardedDataset.open(dataset, verify=True)
    summary = dataset_stats(ds)
    png = png or dataset.absolute().parent / f"{dataset.absolute().name}-doc-lengths.png"
    plot_doc_lengths(summary, png)
    if as_json:
        typer.echo(json.dumps(_stats_json(summary, png), indent=2))
        return
    console = Console(highlight=False)
    _print_stages(console, summary.stages)
    console.print(_splits_table(ds.manifest["splits"]))
    console.print(_licenses_table(summary.licenses))
    for reason, d in summary.dedup.items():
        console.print(f"{reason}: {d['dropped']} of {d['seen']} documents ({d['rate']:.1%})")
    console.print(f"document length histogram: {png}")


@app.command("export-megatron")
def export_megatron_cmd(
    dataset: Annotated[Path, typer.Argument(help="Dataset directory.")],
    out: Annotated[
        Path, typer.Option("--out", help="Output prefix; writes PREFIX_<split>.bin/.idx.")
    ],
) -> None:
    """Write Megatron-LM indexed datasets (MMIDIDX .bin/.idx), one sequence per document."""
    ds = ShardedDataset.open(dataset, verify=True)
    for w in export_megatron(ds, out):
        typer.echo(
            f"{w['prefix']}.bin/.idx: {w['documents']} documents, "
            f"{w['tokens']} tokens ({w['dtype']})"
        )


def _print_stages(console: Console, stages: list[dict[str, Any]]) -> None:
    """A table of what every stage kept and dropped (by reason), then each stage's notes."""
    table = Table(title="Stages")
    table.add_column("stage")
    for col in ("seen", "kept", "MB in", "MB out"):
        table.add_column(col, justify="right")
    table.add_column("dropped (reason: documents)")
    for s in stages:
        table.add_row(
            s["name"],
            str(s["seen"]),
            str(s["kept"]),
            f"{s['bytes_in'] / 1e6:.2f}",
            f"{s['bytes_out'] / 1e6:.2f}",
            _counts(s["dropped"]),
        )
    console.print(table)
    for s in stages:
        if s["notes"]:
            console.print(f"[bold]{s['name']}[/] notes: {_counts(s['notes'])}", soft_wrap=True)


def _splits_table(splits: dict[str, dict[str, Any]]) -> Table:
    table = Table(title="Splits")
    for col in ("split", "documents", "tokens", "rows", "shards"):
        table.add_column(col, justify="left" if col == "split" else "right")
    for name, s in splits.items():
        table.add_row(
            name, str(s["documents"]), str(s["tokens"]), str(s["rows"]), str(len(s["shards"]))
        )
    return table


def _licenses_table(licenses: dict[str, int]) -> Table:
    table = Table(title="Licenses (documents)")
    table.add_column("license")
    table.add_column("documents", justify="right")
    for name, n in licenses.items():
        table.add_row(name, str(n))
    return table


def _counts(counter: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in counter.items()) or "-"


def _stats_json(summary: DatasetStats, png: Path) -> dict[str, Any]:
    return {
        "stages": summary.stages,
        "splits": summary.splits,
        "licenses": summary.licenses,
        "dedup": summary.dedup,
        "doc_tokens": {
            s: {
                "documents": len(t),
                "median": float(np.median(t)) if len(t) else 0.0,
                "max": int(t.max()) if len(t) else 0,
            }
            for s, t in summary.doc_tokens.items()
        },
        "png": str(png),
    }
