"""Render the tables of current numbers from benchmarks/results/<benchmark>/<device>/.

    python benchmarks/readme_table.py            # print the tables
    python benchmarks/readme_table.py --write    # rewrite them in their pages
    python benchmarks/readme_table.py --check    # exit 1 if a page differs (a CPU test runs this)

Each table sits in its page (``PAGES``: README.md, docs/kernels.md) between
``<!-- table:NAME -->`` and ``<!-- /table:NAME -->``.
Every row is read from a benchmark's latest JSON; its command is that folder's command.txt.
A benchmark with no results yet renders no rows.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _command(folder: Path, stem: str | None = None) -> str:
    name = "command.txt" if stem is None else f"{stem}.command.txt"
    path = folder / name
    return path.read_text().strip() if path.is_file() else "(no command recorded)"


def _command_line(folder: Path, stem: str | None = None) -> str:
    """The command as one line for a table cell: the first line that is not a ``#`` note,
    with a pointer to the rest of command.txt when there is more."""
    lines = [x for x in _command(folder, stem).splitlines() if x.strip()]
    commands = [x for x in lines if not x.lstrip().startswith("#")]
    if not commands:
        return "(no command recorded)"
    more = len(commands) - 1
    name = "command.txt" if stem is None else f"{stem}.command.txt"
    return commands[0] + (f" (+{more} more in {name})" if more else "")


def _link(folder: Path) -> str:
    rel = folder.relative_to(ROOT).as_posix()
    return f"[{folder.parent.name}/{folder.name}]({rel})"


def _devices(benchmark: str) -> Iterator[Path]:
    base = RESULTS / benchmark
    if base.is_dir():
        yield from sorted(p for p in base.iterdir() if p.is_dir())


def _fmt(x: float, digits: int = 1) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{digits}f}"


# ---- the headline table: one row per benchmark and device ---------------------------------
# Each renderer takes a benchmark's <benchmark>.json (loaded by headline_table) and gives rows.

def _train_step(data: dict) -> list[list[str]]:
    rows = {(r["model"], r["mode"]): r for r in data["results"] if not r.get("error")}
    hybrid = [r for (m, mode), r in rows.items() if not m.startswith("llama")]
    peers = [r for (m, _), r in rows.items() if m.startswith("llama")]
    if not hybrid:
        return []
    best = min(hybrid, key=lambda r: r["step_ms"])
    text = (f"{best['model']} ({best['mode']}): {_fmt(best['step_ms'])} ms/step, "
            f"{_fmt(best['tokens_per_s'], 0)} tokens/s, MFU {100 * best['mfu']:.1f}% of the "
            f"measured {best['matmul_peak_tflops']:.0f} TFLOP/s")
    if peers:
        peer = min(peers, key=lambda r: r["step_ms"])
        text += (f"; same-size Llama ({peer['mode']}) {_fmt(peer['tokens_per_s'], 0)} "
                 f"tokens/s: **{best['tokens_per_s'] / peer['tokens_per_s']:.2f}x**")
    return [["training step, nam56r-350m vs Llama", text]]


def _serve(data: dict) -> list[list[str]]:
    out = []
    for batch, ratio in sorted(data.get("engine_over_hf", {}).items(), key=lambda kv: int(kv[0])):
        eng = next((r for r in data["results"]
                    if r["system"] == "engine" and r["batch"] == int(batch)), None)
        if eng is None or int(batch) != max(int(b) for b in data["engine_over_hf"]):
            continue
        out.append(["serving decode, nam56r-350m, batch " + batch,
                    (f"{_fmt(eng['decode_tok_s'], 0)} tokens/s, {ratio['decode_tok_s']:.1f}x "
                     "transformers `generate` with its default dynamic cache (not its "
                     "static-cache compiled path)")])
    static = data.get("engine_over_hf_static", {})
    if static:
        batch = max(static, key=int)
        eng = next((r for r in data["results"]
                    if r["system"] == "engine" and r["batch"] == int(batch)), None)
        ratio = static[batch]
        if eng is not None:
            # TTFT only from a run whose timed prompts were cold (see serve_decode.py)
            ttft = (f"TTFT p50 {_fmt(eng['ttft_ms_p50'])} ms ({ratio['ttft_ms_p50']:.2f}x the "
                    "peer's), " if "warmup_prompts" in data else
                    "TTFT not measured cold in this run, ")
            out.append(["serving vs transformers' static-cache compiled generate, batch " + batch,
                        (f"decode {ratio['decode_tok_s']:.2f}x, {ttft}"
                         f"ITL p50 {ratio['itl_ms_p50']:.2f}x the peer's")])
    return out


def _muon(data: dict) -> list[list[str]]:
    by = {r["mode"]: r for r in data["results"]}
    ref = by.get("reference")
    fast = next((r for m, r in by.items() if m != "reference"), None)
    if not (ref and fast):
        return []
    return [["AdamW + Muon optimizer step, nam56r-350m",
             (f"{_fmt(fast['replay_ms'])} ms replayed vs {_fmt(ref['replay_ms'])} ms for the "
              f"foreach reference ({ref['replay_ms'] / fast['replay_ms']:.2f}x)")]]


def _data_pipeline(data: dict) -> list[list[str]]:
    stages = {s["stage"]: s for s in data["stages"]}
    e2e = stages.get("end to end, tokenizer given")
    enc = stages.get("encode (megacpp, 2 processes)")
    text = f"{_fmt(e2e['mb_per_s'], 2)} MB/s end to end" if e2e else ""
    if enc:
        text += f", encoder {_fmt(enc['mb_per_s'])} MB/s"
    cpus = data.get("machine", {}).get("cpus")
    return [[f"data build, {data['source_mb']:.0f} MB of C++ ({cpus} cores)", text]]


def _verifier(data: dict) -> list[list[str]]:
    best = max(data["rows"], key=lambda r: r["programs_per_s"])
    return [[f"verifier, HumanEval-X C++ references ({data['workers']} workers)",
             (f"{best['programs_per_s']:.2f} programs/s ({best['config']}), "
              f"{best['cpu_s_per_program']:.3f} CPU-s per program, "
              f"{best['passed']}/{best['programs']} pass")]]


def _commands_block(folder: Path, inline_max: int = 3) -> list[str]:
    """The commands behind a table: inline up to ``inline_max`` lines, else a link to them."""
    rel = folder.relative_to(ROOT).as_posix()
    commands = _command(folder).splitlines()
    if len(commands) > inline_max:
        return ["", (f"Measured in [{rel}]({rel}) by the {len(commands)} lines of "
                     f"[command.txt]({rel}/command.txt).")]
    return ["", f"Measured in [{rel}]({rel}) by:", "", "```bash", *commands, "```"]


def scaling_table() -> str:
    lines = ["| preset | GPUs | strategy | step ms | tokens/s | vs 1 GPU | GiB/GPU | MFU |",
             "|---|---|---|---|---|---|---|---|"]
    folders = list(_devices("scaling"))
    for folder in folders:
        data = _load(folder / "results.json") or {}
        for row in data.get("rows", []):
            if row.get("status") != "ok":
                continue
            strategy = {"single": "one process", "fsdp": "FSDP2"}.get(row["strategy"],
                                                                     row["strategy"].upper())
            lines.append(
                f"| {row['preset']} | {row['world_size']} | {strategy} | {_fmt(row['step_ms'])} "
                f"| {_fmt(row['tokens_per_s'], 0)} | **{row.get('speedup') or 1:.2f}x** | "
                f"{row['peak_mem_gib']:.1f} | {100 * row['mfu']:.1f}% |")
    for folder in folders:
        lines += _commands_block(folder)
    return "\n".join(lines)


def quality_table(benchmark: str = "quality") -> str:
    """One row per candidate; the HumanEval-X columns only where a run sampled."""
    folders = list(_devices(benchmark))
    runs = [(folder, _load(folder / "quality.json") or {}) for folder in folders]
    sampled = any(c.get("humaneval") for _, data in runs
                  for c in data.get("candidates", {}).values())
    head = "| candidate | params (active) | lr | tokens | tokens/s | val bits/byte |"
    lines = [head + (" HumanEval-X pass@1 greedy | pass@10 (n=20, T=0.8) |" if sampled else ""),
             "|---|---|---|---|---|---|" + ("---|---|" if sampled else "")]
    for _, data in runs:
        for name, cand in data.get("candidates", {}).items():
            final = cand.get("final") or {}
            if final.get("final_val_bpb") is None:
                continue
            active = final.get("active_params") or final["params"]
            row = (f"| {name} | {final['params'] / 1e6:.0f}M ({active / 1e6:.0f}M) | "
                   f"{cand['lr']:g} | {final['tokens'] / 1e6:.1f}M | "
                   f"{_fmt(final.get('steady_tokens_per_s') or final['tokens_per_s'], 0)} | "
                   f"**{final['final_val_bpb']:.3f}** |")
            if sampled:
                scores = cand.get("humaneval") or {}
                greedy = other = "not scored" if scores else "not sampled"
                if scores.get("scored"):
                    greedy = f"{scores['greedy']['pass_at_k']['pass@1']:.3f}"
                    other = f"{scores['sampled']['pass_at_k']['pass@10']:.3f}"
                row += f" {greedy} | {other} |"
            lines.append(row)
        goal = data.get("goal") or {}
        if goal.get("final_val_bpb"):
            bpb = goal["final_val_bpb"]
            best = min(goal["dense"], key=lambda name: bpb[name])
            verdict = "met" if goal["met"] else "**not met**"
            lines += ["", (f"The goal, {goal['hybrid']} below both dense models at equal GPU "
                           f"time, is {verdict}: {bpb[goal['hybrid']]:.3f} against {best}'s "
                           f"{bpb[best]:.3f} bits/byte.")]
    for folder in folders:
        lines += _commands_block(folder, inline_max=0)  # long lines: a link keeps the page short
    return "\n".join(lines)


def _fp8(data: dict) -> list[list[str]]:
    out = []
    speed = [r for r in data.get("speed", []) if r["status"] == "ok" and r["float8"] != "off"]
    if speed:
        parts = [f"{r['preset']} {r['speedup']:.2f}x" for r in speed if r["graphs"]]
        eager = [f"{r['preset']} {r['speedup']:.2f}x" for r in speed if not r["graphs"]]
        recipe = speed[0]["float8"]
        out.append([f"FP8 ({recipe}) training against bf16, tokens/s",
                    f"with CUDA graphs {', '.join(parts)}; eager {', '.join(eager)}"])
    loss = [r for r in data.get("loss", []) if r["status"] == "ok" and r["float8"] != "off"]
    for r in loss:
        out.append([f"FP8 ({r['float8']}) training loss, {r['preset']}, {r['steps']} steps",
                    (f"final loss {r['rel_to_bf16'] * 100:+.2f}%, validation "
                     f"{r['val_rel_to_bf16'] * 100:+.2f}% against bf16")])
    return out


HEADLINE: list[tuple[str, Callable[[dict], list[list[str]]]]] = [
    ("train_step", _train_step),
    ("muon_step", _muon),
    ("fp8", _fp8),
    ("serve_decode", _serve),
    ("data_pipeline", _data_pipeline),
    ("verifier_throughput", _verifier),
]


def headline_table() -> str:
    lines = ["| what | device | result | command |", "|---|---|---|---|"]
    for benchmark, render in HEADLINE:
        for folder in _devices(benchmark):
            data = _load(folder / f"{benchmark}.json") or _load(folder / "results.json")
            if not data:
                continue
            for what, text in render(data):
                lines.append(f"| {what} | {_link(folder)} | {text} | "
                             f"`{_command_line(folder)}` |")
    return "\n".join(lines)


# ---- the kernels table: ours against the best peer, per surface and case ------------------

def _kernel_runs(folder: Path) -> Iterator[tuple[str, dict]]:
    for path in sorted(folder.glob("*.json")):
        data = _load(path)
        if data and "rows" in data and "ceilings" in data:
            yield path.stem, data


def kernels_table() -> str:
    lines = [("| surface | case | ours (chosen): per call / replay ms "
              "| peer: per call / replay ms | ours vs peer, per call / replay |"),
             "|---|---|---|---|---|"]
    commands = []
    for folder in _devices("kernels"):
        cases: dict[tuple[str, str], list[dict]] = {}
        for stem, data in _kernel_runs(folder):
            commands.append(_command_line(folder, None if stem == "kernels" else stem))
            for row in data["rows"]:
                cases.setdefault((row["surface"], row["case"]), []).append(row)
        for (surface, case), rows in cases.items():
            chosen = next((r for r in rows if r["role"] == "chosen" and r.get("ms")), None)
            others = [r for r in rows if r is not chosen and r.get("ms")]
            if chosen is None or not others:
                continue
            donors = [r for r in others if r["role"] == "donor"]  # a named peer, where one ran
            peer = min(donors or others, key=lambda r: r.get("graphed_ms") or r["ms"])
            replay = (f"{chosen['graphed_ms']:.3f}" if chosen.get("graphed_ms") else "n/a")
            peer_replay = f"{peer['graphed_ms']:.3f}" if peer.get("graphed_ms") else "no replay"
            ratio = f"{peer['ms'] / chosen['ms']:.2f}x"
            if chosen.get("graphed_ms") and peer.get("graphed_ms"):
                ratio += f" / {peer['graphed_ms'] / chosen['graphed_ms']:.2f}x"
            lines.append(f"| {surface} | {case} | {chosen['backend']}: {chosen['ms']:.3f} / "
                         f"{replay} | {peer['backend']} ({peer['role']}): {peer['ms']:.3f} / "
                         f"{peer_replay} | {ratio} |")
    if commands:
        lines += ["", "Commands (H100, the peers' wheels from `scripts/peer_wheels.sh`):", ""]
        lines += [f"    {c}" for c in commands]
    return "\n".join(lines)


def ablation_table() -> str:
    """The feature ablations (``quality.py`` candidates, one line each): tokens/s and the
    final bits/byte, or the last point of a run stopped before its final evaluation."""
    folders = list(_devices("ablation"))
    lines = ["| candidate | tokens/s | val bits/byte |", "|---|---|---|"]
    for folder in folders:
        for name, cand in ((_load(folder / "quality.json") or {}).get("candidates") or {}).items():
            final = cand.get("final") or {}
            if final.get("final_val_bpb") is not None:
                bpb = f"**{final['final_val_bpb']:.3f}**"
            elif final.get("last_val_bpb") is not None:
                bpb = f"{final['last_val_bpb']:.3f} (stopped at step {final['last_step']})"
            else:
                continue
            lines.append(f"| {name} | {_fmt(final.get('steady_tokens_per_s'), 0)} | {bpb} |")
    for folder in folders:
        lines += _commands_block(folder, inline_max=0)
    return "\n".join(lines)


TABLES = {"quality": lambda: quality_table("quality_recipe"), "ablation": ablation_table,
          "scaling": scaling_table, "results": headline_table, "kernels": kernels_table}
# the page each table lives on: the README's numbers, the kernel table in the kernels doc
PAGES = {README: ("quality", "ablation", "scaling", "results"),
         ROOT / "docs" / "kernels.md": ("kernels",)}


def render(page: str, names: tuple[str, ...] = tuple(TABLES), where: str = "README.md") -> str:
    for name in names:
        pattern = re.compile(rf"(<!-- table:{name} -->\n)(.*?)(<!-- /table:{name} -->)", re.DOTALL)
        if not pattern.search(page):
            raise SystemExit(f"error: {where} has no <!-- table:{name} --> block")
        table = TABLES[name]()
        page = pattern.sub(lambda m, t=table: m.group(1) + t + "\n" + m.group(3), page)
    return page


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the tables in their pages")
    mode.add_argument("--check", action="store_true", help="exit 1 if a page is stale")
    args = ap.parse_args()
    if not (args.write or args.check):
        for name, make in TABLES.items():
            print(f"<!-- table:{name} -->\n{make()}\n")
        return 0
    stale = []
    for path, names in PAGES.items():
        where = path.relative_to(ROOT).as_posix()
        current = path.read_text()
        rendered = render(current, names, where)
        if args.write:
            path.write_text(rendered)
        elif rendered != current:
            stale.append(where)
    if stale:
        print(f"error: the tables of {', '.join(stale)} differ from benchmarks/results; run "
              "python benchmarks/readme_table.py --write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
