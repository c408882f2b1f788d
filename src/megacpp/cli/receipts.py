"""``megacpp receipts``: show, compare, golden.

``compare`` prints metric ratios only when the two receipts' environments agree on the
contract; otherwise it lists the drift and exits 1 (``--allow-drift`` compares anyway and
stamps the output).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from megacpp.receipts import compare_receipts, mark_golden, read_receipt, verify_artifacts

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Run/bench/eval receipts.")
console = Console()


def _print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, default=str))


@app.command()
def show(
    file: Path = typer.Argument(..., help="Receipt JSON."),
    as_json: bool = typer.Option(False, "--json", help="Print the validated receipt as JSON."),
) -> None:
    """Validate a receipt and print it, checking its artifacts against the files on disk."""
    receipt = read_receipt(file)
    artifacts = verify_artifacts(receipt, file)
    if as_json:
        _print_json({**receipt.to_dict(), "artifact_status": artifacts})
        return
    fp, git = receipt.full_fingerprint, receipt.git or {}
    device = ", ".join(f"{d['name']} ({d['arch']})" for d in fp.get("devices") or []) or "CPU"
    table = Table(
        title=f"{receipt.kind} receipt {file.name}" + (" [GOLDEN]" if receipt.golden else ""),
        show_header=False,
    )
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    rows = [
        ("created", receipt.created),
        ("device", device),
        ("torch / CUDA", f"{fp['packages'].get('torch')} / {(fp.get('torch') or {}).get('cuda')}"),
        ("git", f"{git.get('sha')} dirty={git.get('dirty')}" if git else "unknown"),
        ("config_sha256", receipt.config_sha256),
        ("kernels", ", ".join(f"{k}={v}" for k, v in receipt.kernels.items()) or "-"),
        ("patches", ", ".join(p.get("name", "?") for p in receipt.patches) or "none"),
        ("preflight skipped", ", ".join(receipt.preflight_skipped) or "none"),
    ]
    rows += [(f"metric {k}", f"{v:g}") for k, v in receipt.metrics.items()]
    rows += [(f"artifact {path}", status) for path, status in artifacts.items()]
    for field, value in rows:
        table.add_row(field, value)
    console.print(table)
    if any(status != "ok" for status in artifacts.values()):
        raise SystemExit(1)


@app.command()
def compare(
    a: Path = typer.Argument(..., help="Receipt A (the baseline)."),
    b: Path = typer.Argument(..., help="Receipt B."),
    metric: str | None = typer.Option(None, "--metric", help="Compare only this metric."),
    allow_drift: bool = typer.Option(
        False, "--allow-drift", help="Compare despite contract drift (stamped on the output)."
    ),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Metric ratios B/A when both receipts come from the same contract environment."""
    comparison = compare_receipts(
        read_receipt(a), read_receipt(b), metric=metric, allow_drift=allow_drift
    )
    if as_json:
        _print_json(comparison.to_dict())
        return
    if comparison.drift_allowed:
        console.print(
            "[bold red]DRIFT ALLOWED[/]: these receipts come from environments that "
            "differ on contract fields; the ratios below are not like-for-like:"
        )
        for d in comparison.drift:
            console.print(f"  {d.field}: {d.a!r} -> {d.b!r} ({d.reason})")
    table = Table(title=f"{b.name} / {a.name}" + (" [DRIFTED]" if comparison.drift_allowed else ""))
    for column in ("metric", "A", "B", "B/A"):
        table.add_column(column)
    for row in comparison.rows:
        ratio = f"{row.ratio:.4f}" if row.ratio is not None else "n/a (A is 0)"
        table.add_row(row.name, f"{row.a:g}", f"{row.b:g}", ratio)
    console.print(table)
    for note in comparison.notes:
        console.print(f"note: {note}")


@app.command()
def golden(
    file: Path = typer.Argument(..., help="Receipt to mark golden."),
    project_root: Path | None = typer.Option(
        None, "--project-root", help="Checkout whose git state to check."
    ),
) -> None:
    """Mark a receipt golden: only from its own clean commit and a verified environment."""
    receipt = mark_golden(file, project_root=project_root)
    console.print(f"{file} is golden (commit {(receipt.git or {}).get('sha')})")
