"""``megacpp env``: capture, diff, devices, mfu, preflight, verify-site, patches.

Thin: parse, call :mod:`megacpp.contract`, print a rich table or ``--json``. Exit status:
0 fine, 1 a finding (contract drift, a preflight error, a package that does not verify),
2 bad input.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from megacpp.cli._options import CONTRACT_CONFIG_HELP
from megacpp.contract import probes
from megacpp.contract.config import ContractConfig, load_contract_config, parse_kernel_option
from megacpp.contract.devices import device_profile, known_profiles, mfu, profile_for_fingerprint
from megacpp.contract.diff import diff_fingerprints
from megacpp.contract.fingerprint import (
    capture_fingerprint,
    check_fingerprint,
    contract_packages,
    read_json_file,
)
from megacpp.contract.integrity import IntegrityReport, describe_problems, verify_site
from megacpp.contract.patches import PATCHES
from megacpp.contract.preflight import PreflightInputs, read_cache_routings, run_rules

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="The environment contract.")
console = Console()
err_console = Console(stderr=True)

_SEVERITY_STYLE = {
    "error": "bold red",
    "warning": "yellow",
    "info": "cyan",
    "pass": "green",
    "n/a": "dim",
}


def _print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, default=str))


def load_facts(path: Path) -> dict[str, Any]:
    """A fingerprint from a fingerprint file or from a receipt (its environment)."""
    from megacpp.receipts.schema import RECEIPT_SCHEMA, receipt_from_dict

    data = read_json_file(path, "fingerprint")
    if isinstance(data, dict) and data.get("schema") == RECEIPT_SCHEMA:
        return receipt_from_dict(data, source=str(path)).full_fingerprint
    check_fingerprint(data, source=str(path))
    return data


def _config(path: Path | None, packages: str | None = None) -> ContractConfig:
    config = load_contract_config(path)
    if packages:
        names = [p.strip() for p in packages.split(",") if p.strip()]
        config = ContractConfig(tuple(contract_packages(names)), config.skip, config.kernels)
    return config


# --- capture -------------------------------------------------------------------------------------


@app.command()
def capture(
    out: Path | None = typer.Option(None, "--out", help="Write the fingerprint JSON here."),
    as_json: bool = typer.Option(False, "--json", help="Print the fingerprint as JSON."),
    config: Path | None = typer.Option(None, "--config", help=CONTRACT_CONFIG_HELP),
    packages: str | None = typer.Option(
        None, "--packages", help="Comma-separated contract packages (replaces the list)."
    ),
    project_root: Path | None = typer.Option(
        None, "--project-root", help="Where to read git state (default: megacpp's checkout)."
    ),
) -> None:
    """Capture this machine's environment contract (OS, torch, CUDA, GPUs, packages, git)."""
    from megacpp._io import atomic_write_json

    fingerprint = capture_fingerprint(
        packages=_config(config, packages).packages, project_root=project_root
    )
    if out is not None:
        atomic_write_json(out, fingerprint)
        err_console.print(f"wrote {out}")
    if as_json:
        _print_json(fingerprint)
    elif out is None:
        _print_fingerprint(fingerprint)


def _print_fingerprint(fp: dict[str, Any]) -> None:
    table = Table(title="environment fingerprint", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    torch_build, driver, tools = fp.get("torch") or {}, fp.get("driver") or {}, fp["toolchain"]
    rows = [
        ("host", f"{fp['host']['hostname']} · {fp['host']['os']} · kernel {fp['host']['kernel']}"),
        ("cpu", f"{fp['host']['cpu_model']} ({fp['host']['cpu_count']} cores)"),
        ("python", fp["python"]["version"]),
        (
            "torch",
            (f"{fp['packages'].get('torch')} (CUDA {torch_build.get('cuda')}, cuDNN "
             f"{torch_build.get('cudnn')}, NCCL {torch_build.get('nccl')})"),
        ),
        ("triton", str(fp["packages"].get("triton"))),
        ("driver", f"{driver.get('version')} (CUDA {driver.get('cuda_version')})"),
        ("nvcc / gcc / g++", f"{tools.get('nvcc')} / {tools.get('gcc')} / {tools.get('gxx')}"),
    ]
    rows += [(f"device {d['index']}", _device_line(d)) for d in fp["devices"]] or [
        ("device", "CPU only")
    ]
    rows += [
        (f"package {n}", str(v)) for n, v in fp["packages"].items() if n not in ("torch", "triton")
    ]
    rows += [(f"env {k}", v) for k, v in fp["env"].items()]
    git = fp.get("git")
    git_row = f"{git['sha']} dirty={git['dirty']}" if git else "null (no git repository)"
    if git and git.get("declared_commit"):
        git_row += f" (declared source commit {git['declared_commit']})"
    rows.append(("git", git_row))
    rows.append(("patches", ", ".join(p["name"] for p in fp["patches"]) or "none"))
    for field, value in rows:
        table.add_row(field, value)
    console.print(table)


def _device_line(d: dict[str, Any]) -> str:
    smem = d.get("smem_per_block_optin_bytes")
    smem_text = f"{smem // 1024} KiB smem/block" if smem else "smem unknown"
    return (
        f"{d['name']} · {d['arch']} · {d['sm_count']} SMs · {smem_text} · "
        f"{d['total_memory_bytes'] / 2**30:.1f} GiB"
    )


# --- diff ----------------------------------------------------------------------------------------


@app.command()
def diff(
    a: Path = typer.Argument(..., help="Fingerprint JSON or receipt (A)."),
    b: Path = typer.Argument(..., help="Fingerprint JSON or receipt (B)."),
    as_json: bool = typer.Option(False, "--json", help="Print the differences as JSON."),
) -> None:
    """Every difference between two environments; exit 1 if any is contract-breaking."""
    differences = diff_fingerprints(load_facts(a), load_facts(b))
    breaking = [d for d in differences if d.contract]
    if as_json:
        _print_json(
            {"contract_breaking": len(breaking), "differences": [d.to_dict() for d in differences]}
        )
    else:
        table = Table(title=f"{a.name} vs {b.name}")
        for column in ("field", "A", "B", "class", "why"):
            table.add_column(column, overflow="fold")
        for d in differences:
            label = "[bold red]CONTRACT[/]" if d.contract else "[dim]info[/]"
            table.add_row(d.field, _short(d.a), _short(d.b), label, d.reason)
        console.print(table)
        verdict = (
            f"[bold red]{len(breaking)} contract-breaking difference(s)[/]: results are "
            "not comparable"
            if breaking
            else "[green]no contract-breaking differences[/]"
        )
        console.print(f"{len(differences)} difference(s); {verdict}")
    if breaking:
        raise SystemExit(1)


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


# --- devices and mfu -----------------------------------------------------------------------------


@app.command()
def devices(as_json: bool = typer.Option(False, "--json", help="Print profiles as JSON.")) -> None:
    """The device profile table (with the source of every figure in --json)."""
    profiles = known_profiles()
    if as_json:
        _print_json([p.to_dict() for p in profiles])
        return
    table = Table(title="device profiles (dense peaks, TFLOP/s)")
    for column in (
        "key",
        "name",
        "arch",
        "targets",
        "SMs",
        "smem/block",
        "GB/s",
        "bf16",
        "fp8",
        "fp4",
    ):
        table.add_column(column)
    for p in profiles:
        smem = f"{p.max_smem_per_block_bytes // 1024} KiB" if p.max_smem_per_block_bytes else "-"
        table.add_row(
            p.key,
            p.name,
            p.arch or "-",
            " ".join(p.compile_targets) or "-",
            str(p.sm_count or "-"),
            smem,
            str(p.memory_bandwidth_gbs or "-"),
            *(str(p.peak(d) or "n/a") for d in ("bf16", "fp8", "fp4")),
        )
    console.print(table)


@app.command("mfu")
def mfu_command(
    flops_per_token: float = typer.Option(..., "--flops-per-token", help="Model FLOPs per token."),
    tokens_per_s: float = typer.Option(..., "--tokens-per-s", help="Measured tokens per second."),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16, fp8 or fp4."),
    peak: float | None = typer.Option(
        None, "--peak", help="Peak TFLOP/s to use instead of the table."
    ),
    device: str | None = typer.Option(
        None, "--device", help="Device key or name (default: this GPU)."
    ),
    facts: Path | None = typer.Option(None, "--facts", help="Use device 0 of this fingerprint."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Model-FLOPs utilisation against this device's own peak (n/a when unknown)."""
    if device is not None:
        profile = device_profile(device)
    elif facts is not None:
        profile = profile_for_fingerprint(load_facts(facts))
    else:
        live = probes.cuda_devices()
        profile = device_profile(live[0] if live else None)
    result = mfu(flops_per_token, tokens_per_s, profile, dtype=dtype, peak_tflops=peak)
    if as_json:
        _print_json(result.to_dict())
        return
    achieved = f"{result.achieved_tflops:.2f} TFLOP/s achieved"
    if result.mfu is None:
        console.print(f"MFU: [bold]n/a[/] on {result.device} ({achieved}). {result.peak_source}")
    else:
        console.print(
            f"MFU: [bold]{result.mfu:.1%}[/] of {result.device} dense {dtype} peak "
            f"{result.peak_tflops:g} TFLOP/s ({achieved}). Peak: {result.peak_source}"
        )


# --- preflight -----------------------------------------------------------------------------------


@app.command()
def preflight(
    config: Path | None = typer.Option(None, "--config", help=CONTRACT_CONFIG_HELP),
    facts: Path | None = typer.Option(
        None, "--facts", help="Check this fingerprint/receipt instead of this machine."
    ),
    skip: list[str] = typer.Option([], "--skip", help="Rule id to skip (repeatable)."),
    kernel: list[str] = typer.Option(
        [], "--kernel", help="NAME=BYTES shared memory a chosen kernel needs (repeatable)."
    ),
    no_integrity: bool = typer.Option(
        False, "--no-integrity", help="Do not hash the contract packages (rule site-integrity)."
    ),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Check known device/toolchain traps; exit 1 on an error finding."""
    contract = load_contract_config(config)
    kernels = [*contract.kernels, *(parse_kernel_option(k) for k in kernel)]
    fingerprint = load_facts(facts) if facts else capture_fingerprint(packages=contract.packages)
    integrity = None
    if facts is None and not no_integrity:
        integrity = _verify_with_progress(list(contract.packages), installed_only=True)
    inputs = PreflightInputs(fingerprint, kernels, integrity, read_cache_routings(fingerprint))
    report = run_rules(inputs, skip=[*contract.skip, *skip])
    if as_json:
        _print_json(report.to_dict())
    else:
        table = Table(title="preflight")
        for column in ("rule", "result", "message", "fix"):
            table.add_column(column, overflow="fold")
        for f in report.findings:
            style = _SEVERITY_STYLE[f.severity]
            table.add_row(f.rule, f"[{style}]{f.severity}[/]", f.message, f.fix)
        for rule in report.skipped:
            table.add_row(
                rule, "[magenta]skipped[/]", "skipped by request (recorded in receipts)", ""
            )
        console.print(table)
        console.print(f"{len(report.errors)} error(s), {len(report.warnings)} warning(s)")
    if not report.ok:
        raise SystemExit(1)


# --- verify-site ---------------------------------------------------------------------------------


@app.command("verify-site")
def verify_site_command(
    packages: list[str] = typer.Argument(
        None, help="Distributions to verify (default: contract packages)."
    ),
    path: Path | None = typer.Option(
        None, "--path", help="Site directory to check instead of sys.path."
    ),
    all_: bool = typer.Option(False, "--all", help="Verify every distribution found."),
    config: Path | None = typer.Option(None, "--config", help=CONTRACT_CONFIG_HELP),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Check installed files against the sha256 hashes in their RECORD; exit 1 on any problem."""
    if packages:
        names, installed_only = packages, False
    elif all_ or path is not None:
        names, installed_only = None, False
    else:
        names, installed_only = list(_config(config).packages), True
    reports = _verify_with_progress(names, path=path, installed_only=installed_only)
    if as_json:
        _print_json([r.to_dict() for r in reports])
    else:
        table = Table(title=f"site integrity ({path or 'sys.path'})")
        for column in ("package", "version", "result", "details"):
            table.add_column(column, overflow="fold")
        for r in reports:
            result = "[green]ok[/]" if r.ok else "[bold red]FAILED[/]"
            table.add_row(r.name, r.version, result, r.summary() if r.ok else describe_problems(r))
        console.print(table)
    if not all(r.ok for r in reports):
        raise SystemExit(1)


def _verify_with_progress(
    names: list[str] | None, path: Path | None = None, installed_only: bool = False
) -> list[IntegrityReport]:
    columns = (TextColumn("verifying {task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, console=err_console, transient=True) as progress:
        task = progress.add_task("packages", total=None)

        def update(name: str, done: int, total: int) -> None:
            progress.update(task, description=name, completed=done, total=total)

        return verify_site(names, path=path, installed_only=installed_only, progress=update)


# --- patches -------------------------------------------------------------------------------------


@app.command()
def patches(
    facts: Path | None = typer.Option(
        None, "--facts", help="Judge predicates on this fingerprint."
    ),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """The patch inventory and which patches would apply here."""
    fingerprint = load_facts(facts) if facts else capture_fingerprint()
    rows = [
        {
            "name": p.name,
            "target": p.target,
            "applies": verdict.applies,
            "why": verdict.reason,
            "reason": p.reason,
            "upstream": p.upstream,
        }
        for p in PATCHES.values()
        for verdict in [p.applicability(fingerprint)]
    ]
    if as_json:
        _print_json(rows)
        return
    table = Table(title="patch lane (in-memory, revertible, recorded in receipts)")
    for column in ("patch", "target", "applies here", "why", "upstream"):
        table.add_column(column, overflow="fold")
    for row in rows:
        applies = "[green]yes[/]" if row["applies"] else "[dim]no[/]"
        table.add_row(row["name"], row["target"], applies, row["why"], row["upstream"])
    console.print(table)
