"""The README's figures, rendered from the JSON the bench commands wrote.

The README holds no hand-typed figure: its table sits between two markers and is
rendered from `docs/figures/*.json`, each a copy of what one command wrote
(`agentkv demo` → `demo.json`, `agentkv bench reuse` → `reuse.json`, …) with the
command, date, commit and machine it was measured on. A test renders the table and
fails when the README differs, so a figure cannot go stale silently.

    python -m agentkv_bench.figures collect demo=agentkv-out/demo.json reuse=runs/reuse/reuse.json
    python -m agentkv_bench.figures render      # rewrite the README's table
    python -m agentkv_bench.figures check       # exit 1 when the README differs
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
FIGURES_DIR = ROOT / "docs" / "figures"
README = ROOT / "README.md"
BEGIN = "<!-- figures: rendered by `python -m agentkv_bench.figures render` from docs/figures/*.json -->"
END = "<!-- figures: end -->"
MIB = 1024 * 1024

Row = tuple[str, str]
"""One table row: (what was measured, the figure)."""


@dataclass(frozen=True)
class Source:
    """One command whose JSON feeds the table: its name, the command line, its rows."""

    name: str
    command: str
    rows: Callable[[Mapping[str, Any]], list[Row]]


def _mib(n: float) -> str:
    return f"{n / MIB:,.1f} MiB"


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _demo_rows(data: Mapping[str, Any]) -> list[Row]:
    s = data["summary"]
    ours, full = "agentkv", "full"
    device, host = s["final_device_bytes"], s["final_host_bytes"]
    total = s["final_total_bytes"]
    budget = s.get("budget_tokens")
    where = f"{s['turns']}-turn tool agent, {budget}-token device budget" if budget else f"{s['turns']} turns"
    recall = s.get("recall", [])
    right = {run: sum(bool(a.get(f"{run}_correct")) for a in recall) for run in (ours, full)}
    return [
        (
            f"KV at the end of the demo ({where}): device + host = total",
            f"agentkv {_mib(device[ours])} + {_mib(host[ours])} = {_mib(total[ours])}; "
            f"full cache {_mib(device[full])} + {_mib(host[full])} = {_mib(total[full])} "
            f"({_pct(s['device_saved'])} less on the device, {_pct(s['total_saved'])} less in total)",
        ),
        (
            "Tokens prefilled over the demo (agentkv vs re-encoding every call)",
            f"{s['total_prefilled'][ours]:,} vs {s['total_prefilled'][full]:,}",
        ),
        (
            "First token sooner than re-encoding: last turn / all turns",
            f"{s['ttft_speedup_last_turn']:.1f}x / {s['ttft_speedup_overall']:.1f}x",
        ),
        (
            "Demo recall questions about the first turns' tool results, answered right",
            f"agentkv {right[ours]} of {len(recall)}; full cache {right[full]} of {len(recall)}",
        ),
    ]


def _reuse_rows(data: Mapping[str, Any]) -> list[Row]:
    s = data["summary"]
    rows: list[Row] = [
        (
            f"Tokens encoded over {s['turns']} turns ({s['final_history_tokens']:,}-token history): "
            "reuse vs re-encoding",
            f"{s['reuse_prefill_tokens']:,} vs {s['reencode_prefill_tokens']:,} "
            f"({s['reencode_prefill_tokens'] / max(s['reuse_prefill_tokens'], 1):.1f}x fewer)",
        ),
        ("First token on the last turn, sooner than re-encoding", f"{s['last_turn_ttft_speedup']:.1f}x"),
    ]
    overhead = s.get("overhead", {})
    parts = [
        f"{kind} turns {overhead[kind]['median_ratio']:.2f}x (worst {overhead[kind]['worst_ratio']:.2f}x)"
        for kind in ("short", "long")
        if isinstance(overhead.get(kind), Mapping)
    ]
    if parts:
        rows.append(
            (
                "A model call against a bare forward over the same cache, "
                f"past {overhead['cache_at_least']:,} cached tokens (median)",
                "; ".join(parts),
            )
        )
    decode = s.get("decode", {})
    if "ratio" in decode:
        rows.append(("Decode rate against `model.generate` (same cache)", f"{decode['ratio']:.2f}x"))
    return rows


def _tools_rows(data: Mapping[str, Any]) -> list[Row]:
    on, off = data["summary"]["grammar"], data["summary"]["free"]
    return [
        (
            "Forced tool calls that parse / validate: grammar on (off)",
            f"{_pct(on['forced_parsed'])} / {_pct(on['forced_valid'])} "
            f"({_pct(off['forced_parsed'])} / {_pct(off['forced_valid'])})",
        ),
        (
            "Structured output that validates: grammar on (off)",
            f"{_pct(on['structured_valid'])} ({_pct(off['structured_valid'])})",
        ),
    ]


def _threads_rows(data: Mapping[str, Any]) -> list[Row]:
    rows = data["rows"]
    top = max(rows, key=lambda r: r["threads"])
    return [
        (
            f"First call of threads 2..{top['threads']} sharing a system prompt + tools: "
            "prefix cache on vs off",
            f"{top['first_call_ttft_s_threads2N_shared'] * 1000:,.0f} ms vs "
            f"{top['first_call_ttft_s_threads2N_unshared'] * 1000:,.0f} ms; "
            f"prefill {top['prefill_tokens_shared']:,} vs {top['prefill_tokens_unshared']:,} tokens",
        )
    ]


SOURCES = (
    Source("demo", "agentkv demo", _demo_rows),
    Source("reuse", "agentkv bench reuse", _reuse_rows),
    Source("tools", "agentkv bench tools", _tools_rows),
    Source("threads", "agentkv bench threads --counts 1,8", _threads_rows),
)


def load(figures_dir: Path = FIGURES_DIR) -> dict[str, dict[str, Any]]:
    """The collected JSON of every source that has been collected, by source name."""
    found = {}
    for source in SOURCES:
        path = figures_dir / f"{source.name}.json"
        if path.exists():
            found[source.name] = json.loads(path.read_text(encoding="utf-8"))
    return found


def render(collected: Mapping[str, Mapping[str, Any]]) -> str:
    """The README's figures block (markers included), one table row per figure."""
    lines = [BEGIN, "", "| figure | measured | command (when, where) |", "|---|---|---|"]
    for source in SOURCES:
        data = collected.get(source.name)
        if data is None:
            continue
        where = data.get("_provenance", {})
        command = where.get("command", source.command)
        when = f"{where.get('date', '?')}, commit {where.get('commit', '?')}"
        origin = f"`{command}` ({when}, {where.get('machine', '?')})"
        for what, figure in source.rows(data):
            lines.append(f"| {what} | {figure} | {origin} |")
    lines += ["", END]
    return "\n".join(lines)


def readme_block(text: str) -> str:
    """The README's current figures block (markers included)."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        msg = f"README.md: the figures markers are missing (expected {BEGIN!r} … {END!r})"
        raise ValueError(msg)
    return text[start : end + len(END)]


def _machine() -> str:
    cores = os.cpu_count() or 0
    return f"{platform.machine()} CPU, {cores} cores"


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return out.stdout.strip()


def collect(
    pairs: Sequence[str],
    figures_dir: Path = FIGURES_DIR,
    *,
    command: str | None = None,
    commit: str | None = None,
    note: str | None = None,
) -> list[Path]:
    """Copy `name=path` JSON files into `figures_dir`, stamped with where and when they were measured.

    `commit` names the tree that ran the command (default: this checkout's HEAD); `note`
    says what else shared the machine, when something did.
    """
    names = {s.name: s for s in SOURCES}
    written = []
    for pair in pairs:
        name, _, path = pair.partition("=")
        if name not in names or not path:
            msg = f"collect: expected NAME=PATH with NAME one of {sorted(names)}, got {pair!r}"
            raise ValueError(msg)
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        data["_provenance"] = {
            "command": command or names[name].command,
            "date": dt.date.today().isoformat(),
            "commit": commit or _commit(),
            "machine": _machine() + (f"; {note}" if note else ""),
        }
        figures_dir.mkdir(parents=True, exist_ok=True)
        target = figures_dir / f"{name}.json"
        target.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        written.append(target)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """`collect NAME=PATH …`, `render` or `check` (exit 1 when the README differs)."""
    parser = argparse.ArgumentParser(prog="python -m agentkv_bench.figures", description=__doc__)
    sub = parser.add_subparsers(dest="action", required=True)
    gather = sub.add_parser("collect", help="copy bench JSON into docs/figures/ with its provenance")
    gather.add_argument("pairs", nargs="+", metavar="NAME=PATH")
    gather.add_argument("--command", help="the command line that produced it (default: the source's)")
    gather.add_argument("--commit", help="the commit that ran it (default: this checkout's HEAD)")
    gather.add_argument("--note", help="what else shared the machine while it ran")
    sub.add_parser("render", help="rewrite the README's figures block")
    sub.add_parser("check", help="exit 1 when the README's figures block differs from the rendering")
    args = parser.parse_args(argv)
    if args.action == "collect":
        for path in collect(args.pairs, command=args.command, commit=args.commit, note=args.note):
            print(f"wrote {path.relative_to(ROOT)}")
        return 0
    text = README.read_text(encoding="utf-8")
    current, wanted = readme_block(text), render(load())
    if args.action == "check":
        if current != wanted:
            print(
                "README.md's figures differ from docs/figures/*.json: "
                "run `python -m agentkv_bench.figures render`"
            )
            return 1
        return 0
    README.write_text(text.replace(current, wanted), encoding="utf-8")
    print("README.md: figures rendered")
    return 0


if __name__ == "__main__":
    sys.exit(main())
