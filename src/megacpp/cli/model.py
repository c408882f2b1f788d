"""``megacpp model ...``: work with hybrid patterns (translate; describe lands here too)."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from megacpp.errors import MegaCppError
from megacpp.pattern import LayerPlan, load
from megacpp.pattern.megatron import (
    MEGATRON_CORE_VERIFIED,
    MEGATRON_LM_ARGUMENTS_SOURCE,
    SYMBOL_KINDS,
    SYMBOLS,
    MegatronTranslation,
    to_megatron,
)

app = typer.Typer(no_args_is_help=True)

_TARGETS = ("megatron",)


@app.command()
def translate(
    pattern: Annotated[
        str, typer.Argument(help="A pattern such as '(AEME)x3 | AEMR', or a name (NAM56R).")
    ],
    to: Annotated[str, typer.Option("--to", help="Target framework: megatron.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")] = False,
    num_experts: Annotated[
        int | None,
        typer.Option(help="Experts per MoE layer (E layers need it; the pattern does not fix it)."),
    ] = None,
    moe_router_topk: Annotated[
        int | None, typer.Option(help="Experts each token routes to (Megatron default: 2).")
    ] = None,
) -> None:
    """Translate a pattern into a framework's layer pattern and the flags it implies.

    Fails closed (exit 2) on layers without a verified mapping.
    """
    if to not in _TARGETS:
        raise MegaCppError(f"unknown translation target {to!r}; allowed: {', '.join(_TARGETS)}")
    plan = load(pattern)
    result = to_megatron(plan, num_experts=num_experts, moe_router_topk=moe_router_topk)
    if as_json:
        typer.echo(json.dumps(result.to_json(), indent=2))
    else:
        _print_megatron(result, plan)


def _print_megatron(result: MegatronTranslation, plan: LayerPlan) -> None:
    console = Console(highlight=False)
    title = Text.assemble(
        ("Megatron-Core translation", "bold"), f" of {plan.format(compress=True)}"
    )
    console.print(title, soft_wrap=True)
    console.print(_mapping_table(plan.label_counts))
    console.print(
        f"[bold]hybrid_override_pattern[/] ({result.num_layers} layers, "
        f"stages {list(result.stage_sizes)}):"
    )
    console.print(result.hybrid_override_pattern, soft_wrap=True, markup=False)
    console.print("[bold]Megatron-LM flags:[/]")
    console.print(result.shell_command(), soft_wrap=True, markup=False)
    for note in result.notes:
        console.print(f"- {note}", markup=False)
    installed = result.installed_megatron_core or "not installed"
    console.print(
        f"[dim]verified against megatron-core {MEGATRON_CORE_VERIFIED} (installed: {installed}); "
        f"flag names from {MEGATRON_LM_ARGUMENTS_SOURCE}[/]"
    )


def _mapping_table(label_counts: dict[str, int]) -> Table:
    """One row per layer label present: our label, count, Megatron symbol and layer kind."""
    table = Table("ours", "layers", "megatron", "megatron layer kind")
    for label, symbol in SYMBOLS.items():
        if label in label_counts:
            table.add_row(label, str(label_counts[label]), repr(symbol), SYMBOL_KINDS[symbol])
    return table
