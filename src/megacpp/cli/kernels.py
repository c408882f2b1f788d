"""``megacpp kernels``: list, check, bench -- the kernel catalog from the command line.

Exit status: 0 fine, 1 a finding (a backend failed its check), 2 bad input.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table
from rich.text import Text

from megacpp.cli._options import DEVICE_HELP, resolve_device
from megacpp.errors import MegaCppError
from megacpp.kernels.catalog import DTYPE_NAMES, device_facts, rejection
from megacpp.kernels.check import CheckAborted, check_catalog
from megacpp.kernels.registry import default_catalog
from megacpp.kernels.timing import time_fwd_bwd, time_fwd_bwd_graphed

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="The kernel catalog: list, check, bench.")
console = Console()
err_console = Console(stderr=True)

_ROLE_STYLE = {"chosen": "bold green", "fallback": "cyan", "donor": "magenta", "deferred": "dim"}


def _default_dtype(device: torch.device) -> str:
    return "bfloat16" if device.type == "cuda" else "float32"


_DEVICE = typer.Option("auto", "--device", help=DEVICE_HELP)


def _check_dtypes(dtypes: list[str]) -> list[str]:
    bad = [d for d in dtypes if d not in DTYPE_NAMES]
    if bad:
        raise MegaCppError(f"unknown dtype(s) {bad}; accepted: {', '.join(DTYPE_NAMES)}")
    return dtypes


def _check_surfaces(surfaces: list[str] | None) -> list[str]:
    catalog = default_catalog()
    for name in surfaces or []:
        catalog.surface(name)  # raises with the known names
    return surfaces or list(catalog.surfaces)


@app.command("list")
def list_cmd(
    dtype: str = typer.Option(None, help="operand dtype to qualify for (default: bf16 on GPU)"),
    device: str = _DEVICE,
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Surfaces x backends: role, requirements, and whether each qualifies on this device."""
    on = torch.device(resolve_device(device))
    dtype = _check_dtypes([dtype or _default_dtype(on)])[0]
    catalog, facts = default_catalog(), device_facts(on)
    rows = []
    for b in catalog.backends:
        why = rejection(b, facts, dtype)
        rows.append({"surface": b.surface, "backend": b.name, "role": b.role,
                     "requirements": b.requirements.describe(), "qualifies": why is None,
                     "why_not": why, "reason": b.reason,
                     "smem_bytes": b.requirements.smem_bytes})
    if as_json:
        typer.echo(json.dumps({"device": facts.to_dict(), "dtype": dtype, "backends": rows},
                              indent=2))
        return
    table = Table(title=f"kernel catalog on {facts.name} ({dtype})")
    for col in ("surface", "backend", "role", "requirements", "here"):
        table.add_column(col)
    for r in rows:
        style = _ROLE_STYLE[r["role"]]
        # contracts and reasons carry shapes in brackets ("[T, D]"): escaped, not markup
        here = "[green]yes[/]" if r["qualifies"] else f"[red]no[/]: {escape(r['why_not'])}"
        table.add_row(r["surface"], r["backend"], f"[{style}]{r['role']}[/]",
                      escape(r["requirements"]), here)
    console.print(table)
    for name, surface in catalog.surfaces.items():
        console.print(f"[bold]{name}[/]: {escape(surface.contract)}")


@app.command()
def check(
    surface: list[str] = typer.Option(None, "--surface", "-s", help="surface(s); default all"),
    dtype: list[str] = typer.Option(None, "--dtype", help="dtype(s); default bf16 on GPU"),
    seed: int = typer.Option(0, help="seed of the fresh random inputs"),
    device: str = _DEVICE,
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Every qualifying backend vs the float64 reference, forward and backward. A backend
    that raises is a failure with its error; one that leaves the GPU unusable (an illegal
    address) stops the run after it, with the results so far."""
    device = torch.device(resolve_device(device))
    dtypes = _check_dtypes(dtype or [_default_dtype(device)])
    surfaces = _check_surfaces(surface)
    aborted = None
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("checking", total=None)
        try:
            results = check_catalog(default_catalog(), device, device_facts(device), dtypes,
                                    surfaces, seed, on_result=lambda r: progress.advance(task))
        except CheckAborted as exc:
            results, aborted = exc.results, str(exc)
    if as_json:
        typer.echo(json.dumps([{**r.__dict__, "passed": r.passed} for r in results], indent=2))
    else:
        table = Table(title=f"kernels check on {device}")
        for col in ("surface", "backend", "dtype", "worst rel. err", "tol", "result"):
            table.add_column(col)
        for r in results:
            verdict = (f"[dim]skip: {escape(r.skipped)}[/]" if r.skipped else
                       "[green]pass[/]" if r.passed else
                       f"[red]ERROR[/] {escape(r.error)}" if r.error else
                       f"[red]FAIL[/] {r.errors}")
            worst = "" if r.skipped or r.error else f"{r.worst:.2e}"
            tol = "" if r.skipped else f"{r.tolerance:.0e}"
            table.add_row(r.surface, r.backend, r.dtype, worst, tol, verdict)
        console.print(table)
    if aborted:
        err_console.print(f"[red]error:[/] {escape(aborted)}")
    if aborted or any(r.skipped is None and not r.passed for r in results):
        raise typer.Exit(1)


@app.command()
def bench(
    surface: list[str] = typer.Option(None, "--surface", "-s", help="surface(s); default all"),
    dtype: str = typer.Option(None, help="operand dtype (default: bf16 on GPU, fp32 on CPU)"),
    case: str = typer.Option("check", help="input case: 'check' (small) or a bench case name"),
    repeats: int = typer.Option(10, min=1, help="timed repeats (median reported)"),
    out: Path = typer.Option(None, help="write a 'bench' receipt here"),
    graphed: bool = typer.Option(True, help="on a GPU, also time CUDA-graph replays of each "
                                 "fwd+bwd (no host launch gaps); a backend that cannot be "
                                 "captured shows why"),
    device: str = _DEVICE,
) -> None:
    """Median fwd+bwd time of every qualifying backend (the forward alone for a surface
    without autograd, such as muon_polynomial; on a GPU also peak extra memory and the median
    of CUDA-graph replays, launch gaps gone)."""
    device = torch.device(resolve_device(device))
    dtype = _check_dtypes([dtype or _default_dtype(device)])[0]
    catalog = default_catalog()
    facts = device_facts(device)
    graphed = graphed and device.type == "cuda"
    rows: list[dict[str, Any]] = []
    for name in _check_surfaces(surface):
        surf = catalog.surface(name)
        if surf.make_inputs is None:
            continue
        if case not in surf.cases:
            raise MegaCppError(f"surface {name!r} has no case {case!r}; known: "
                               f"{', '.join(surf.cases)}")
        gen = torch.Generator(device=device).manual_seed(0)
        inputs = surf.make_inputs(surf.cases[case], DTYPE_NAMES[dtype], device, gen)
        for b in catalog.of(name):
            if rejection(b, facts, dtype) is None:
                t = time_fwd_bwd(b.fn, inputs, surf.grad_args, device, repeats=repeats)
                rows.append({"surface": name, "backend": b.name, "role": b.role,
                             "ms": t.median_ms, "peak_extra_bytes": t.peak_extra_bytes})
                if graphed:
                    g = time_fwd_bwd_graphed(b.fn, inputs, surf.grad_args, device,
                                             repeats=repeats)
                    rows[-1].update(graphed_ms=g.median_ms, graphed_failed=g.failure)
    table = Table(title=f"per call on {facts.name} ({dtype}, case {case})")
    for col in ("surface", "backend", "role", "timed", "median ms", "peak extra MiB",
                *(["graph replay ms"] if graphed else [])):
        table.add_column(col)
    for r in rows:
        mib = "" if r["peak_extra_bytes"] is None else f"{r['peak_extra_bytes'] / 2**20:.1f}"
        replay = [] if not graphed else [
            "[dim]no graph[/]" if r["graphed_ms"] is None else f"{r['graphed_ms']:.3f}"]
        timed = "fwd+bwd" if catalog.surface(r["surface"]).grad_args else "fwd"
        table.add_row(r["surface"], r["backend"], r["role"], timed, f"{r['ms']:.3f}", mib,
                      *replay)
    console.print(table)
    for r in rows:
        if r.get("graphed_failed"):
            console.print(Text(f"no graph for {r['surface']}/{r['backend']}: "
                               f"{r['graphed_failed']}", style="dim"))
    if out is not None:
        from megacpp.receipts import write_receipt

        metrics = {f"{r['surface']}/{r['backend']}/ms": r["ms"] for r in rows}
        metrics.update({f"{r['surface']}/{r['backend']}/graphed_ms": r["graphed_ms"]
                        for r in rows if r.get("graphed_ms") is not None})
        kernels = {f"{r['surface']}/{r['backend']}": r["role"] for r in rows}
        write_receipt(out, "bench", {"command": "kernels bench", "dtype": dtype, "case": case,
                                     "repeats": repeats}, metrics, kernels=kernels)
        console.print(f"receipt: {out}")
