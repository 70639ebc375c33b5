"""`agentkv bench …`: the benchmark commands (a separate distribution, `agentkv-bench`).

`agentkv bench ARGS` hands ARGS to `main` here. Each bench prints a table and writes
JSON (and plots) under `--out`; docs/benchmarks.md describes every bench and its figures.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from agentkv.cli_common import AGENTS_EXTRA_HINT, CommandError, load_for_command, progress_bars

logger = logging.getLogger("agentkv_bench.cli")


def build_parser() -> argparse.ArgumentParser:
    """The `agentkv bench` argument parser (its `--help` is the bench reference)."""
    bench = argparse.ArgumentParser(
        prog="agentkv bench",
        description="Benchmarks that print tables and write JSON + PNG (see docs/benchmarks.md).",
    )
    bench.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bars (drawn on stderr, and only when it is a terminal)",
    )
    bench.add_argument(
        "which",
        choices=["reuse", "memory", "soak", "forget", "engine", "threads", "tools", "calls"],
        help=(
            "reuse: session reuse vs re-encoding; memory: fidelity vs device budget; soak: 300+ turns; "
            "threads: N threads sharing one system prompt + tools block (prefix cache on vs off); "
            "forget: the forgetting side thread on tool-heavy traces; "
            "tools: tool calls and structured output with and without the grammar; "
            "calls: the next tool call under a device budget against the full cache's, on tool-use traces; "
            "engine: tool agents on vLLM + LMCache (start it with scripts/serve.sh)"
        ),
    )
    bench.add_argument("--vllm-url", default="http://127.0.0.1:8000", help="engine: vLLM server")
    bench.add_argument(
        "--coordinator-url", default="http://127.0.0.1:9300", help="engine: LMCache coordinator"
    )
    bench.add_argument("--threads", type=int, default=8, help="engine: concurrent agents (default 8)")
    bench.add_argument("--chunk-size", type=int, default=64, help="engine: LMCache chunk (64)")
    bench.add_argument(
        "--device-tokens", type=int, default=768, help="engine: per-session budget, events mode"
    )
    bench.add_argument("--l2-quota-gb", type=float, help="engine: LMCache L2 quota per conversation")
    bench.add_argument(
        "--fleet-l2-gb",
        type=float,
        help="engine: one LMCache L2 budget for all (planner pins whole histories)",
    )
    bench.add_argument(
        "--admission-tokens",
        type=int,
        help="engine: events-gated capacity in working-set tokens (default: the fleet L2 budget)",
    )
    bench.add_argument(
        "--admission-quantum-turns",
        type=int,
        default=4,
        help="engine: events-gated turns a resident keeps its place while others wait (4)",
    )
    bench.add_argument(
        "--modes",
        default="lru,events",
        help="engine: runs besides vllm (lru, events = same prompts with hints, events-gated, events+budget)",
    )
    bench.add_argument(
        "--model", help="HF id, model directory or .gguf path (default: SmolLM2-135M-Instruct)"
    )
    bench.add_argument("--turns", type=int, help="turns (reuse: 30, ~4.5k tokens; soak: 300; threads: 3)")
    bench.add_argument("--counts", help="threads: comma-separated thread counts (default 1,8,32)")
    bench.add_argument("--quick", action="store_true", help="memory, forget: only the 25%% budget")
    bench.add_argument(
        "--methods",
        help=(
            "memory, calls: comma-separated methods (memory default: all; calls: agentkv-nohost; "
            "`full` always runs as the reference)"
        ),
    )
    bench.add_argument(
        "--workloads",
        help="memory, calls: comma-separated workloads (calls: traces), names or JSON paths (default: all)",
    )
    bench.add_argument(
        "--budgets",
        help="memory, calls: budgets as fractions of the full cache (0.5,0.25,0.125; calls: 0.25,0.125)",
    )
    bench.add_argument("--out", default="runs", help="results folder (default runs/)")
    return bench


def cmd_bench(args: argparse.Namespace) -> int:
    """`agentkv bench reuse|memory|soak|forget|engine|threads|tools|calls`."""
    console = Console()
    if not console.is_terminal:  # a pipe or file would get 80 columns and squeeze the wide tables
        console = Console(width=220)
    # Scoping options are checked before the model loads (~15 s): a typo fails at once.
    budgets = _fractions(args.budgets) if args.budgets else (0.25,) if args.quick else (0.5, 0.25, 0.125)
    methods, workloads = _names(args.methods), _names(args.workloads)
    if args.which == "engine":
        return _bench_engine(args, console)
    model, tokenizer = load_for_command(args)
    out = Path(args.out) / args.which
    if args.which == "reuse":
        from agentkv_bench.reuse import run_reuse_bench

        with progress_bars(args) as bars:
            result = run_reuse_bench(model, tokenizer, turns=args.turns or 30, out_dir=out, progress=bars)
        table = Table(
            title="agentkv bench reuse: per turn (reuse | re-encode | bare forward, medians of repeats)"
        )
        for name in (
            "turn",
            "cached",
            "new",
            "prefill re-enc",
            "TTFT reuse ms",
            "TTFT re-enc ms",
            "TTFT bare ms",
            "reuse / bare",
            "re-enc / reuse",
            "decode tok/s",
        ):
            table.add_column(name, justify="right")
        overhead = {r["turn"]: r for r in result["overhead"]}
        for a, b in zip(result["reuse"], result["reencode"], strict=True):
            o = overhead.get(a["turn"])
            table.add_row(
                str(a["turn"]),
                str(a["cached_tokens"]),
                str(a["new_tokens"]),
                str(b["prefill_tokens"]),
                f"{a['ttft_s'] * 1000:,.0f}" if o is None else f"{o['session_ttft_s'] * 1000:,.0f}",
                f"{b['ttft_s'] * 1000:,.0f}",
                "—" if o is None else f"{o['bare_ttft_s'] * 1000:,.0f}",
                "—" if o is None else f"{o['ratio_to_bare']:.2f}",
                f"{b['ttft_s'] / max(a['ttft_s'], 1e-9):.1f}",
                f"{a['decode_tok_s']:.1f}",
            )
        console.print(table)
        summary = dict(result["summary"])
        decode = summary.pop("decode")
        per_call = summary.pop("overhead")
        _print_kv("totals", summary, console)
        for kind in ("short", "long"):
            if kind in per_call:
                _print_kv(
                    f"per-call overhead, {kind} turns over >= {per_call['cache_at_least']} cached",
                    per_call[kind],
                    console,
                )
        _print_kv("decode loop vs model.generate (same full cache)", decode, console)
    elif args.which == "memory":
        from agentkv_bench.memory import acceptance_line, memory_table, run_memory_bench

        with progress_bars(args, log_details=True) as bars:
            result = run_memory_bench(
                model,
                tokenizer,
                budgets=budgets,
                methods=methods,
                workloads=workloads,
                out_dir=out,
                progress=bars,
            )
        console.print(memory_table(result))
        console.print(acceptance_line(result["acceptance"]))
    elif args.which == "forget":
        from agentkv_bench.forget import forget_table, run_forget_bench

        forget_budgets: tuple[float | None, ...] = (0.25,) if args.quick else (None, 0.25)
        with progress_bars(args) as bars:
            result = run_forget_bench(model, tokenizer, budgets=forget_budgets, out_dir=out, progress=bars)
        console.print(forget_table(result))
    elif args.which == "threads":
        from agentkv_bench.threads import run_threads_bench

        counts = tuple(int(n) for n in _names(args.counts) or ["1", "8", "32"])
        with progress_bars(args) as bars:
            result = run_threads_bench(
                model, tokenizer, counts=counts, turns=args.turns or 3, out_dir=out, progress=bars
            )
        console.print(_threads_table(result))
    elif args.which == "tools":
        try:
            from agentkv_bench.tool_bench import run_tools_bench, tools_table
        except ImportError as e:
            msg = f"agentkv bench tools needs LangChain and LangGraph: {AGENTS_EXTRA_HINT} ({e})"
            raise CommandError(msg) from e
        with progress_bars(args) as bars:
            result = run_tools_bench(model, tokenizer, out_dir=out, progress=bars)
        console.print(tools_table(result))
    elif args.which == "calls":
        try:
            from agentkv_bench.call_bench import calls_table, run_calls_bench
        except ImportError as e:
            msg = f"agentkv bench calls needs LangChain: {AGENTS_EXTRA_HINT} ({e})"
            raise CommandError(msg) from e
        calls_budgets = _fractions(args.budgets) if args.budgets else (0.25, 0.125)
        with progress_bars(args) as bars:
            result = run_calls_bench(
                model,
                tokenizer,
                traces=workloads,
                methods=methods or ("agentkv-nohost",),
                budgets=calls_budgets,
                out_dir=out,
                progress=bars,
            )
        console.print(calls_table(result))
    elif args.which == "soak":
        from agentkv_bench.soak import run_soak

        with progress_bars(args) as bars:
            summary = run_soak(model, tokenizer, turns=args.turns or 300, out_dir=out, progress=bars)
        _print_kv("soak", summary, console)
    console.print(f"results in {out}/")
    return 0


def _threads_table(result: dict[str, Any]) -> Table:
    """`bench threads`: one row per N, shared vs unshared."""
    settings = result["settings"]
    table = Table(
        title=(
            f"agentkv bench threads: same {settings['system_prompt_tokens']}-token system prompt + tools, "
            f"{settings['turns']} turns per thread (prefix cache on | off)"
        )
    )
    for name in (
        "N",
        "TTFT 1st call thr 1 ms",
        "TTFT 1st call thr 2..N ms (on | off)",
        "TTFT follow-up ms",
        "1st / follow-up",
        "prefill tokens (on | off)",
        "device MiB (on | off)",
        "prefix MiB",
        "same answers",
    ):
        table.add_column(name, justify="right")
    mib = 1024 * 1024
    for r in result["rows"]:
        table.add_row(
            str(r["threads"]),
            f"{r['first_call_ttft_s_thread1'] * 1000:,.0f}",
            f"{r['first_call_ttft_s_threads2N_shared'] * 1000:,.0f} | "
            f"{r['first_call_ttft_s_threads2N_unshared'] * 1000:,.0f}",
            f"{r['followup_ttft_s_shared'] * 1000:,.0f}",
            f"{r['first_call_over_followup']:.2f}",
            f"{r['prefill_tokens_shared']:,} | {r['prefill_tokens_unshared']:,}",
            f"{r['device_bytes_shared'] / mib:,.1f} | {r['device_bytes_unshared'] / mib:,.1f}",
            f"{r['prefix_bytes'] / mib:,.1f}",
            "yes" if r["answers_identical"] else "NO",
        )
    return table


def _names(value: str | None) -> list[str] | None:
    """`a,b , c` → `["a", "b", "c"]`; None or empty → None (the default set)."""
    if not value:
        return None
    return [part.strip() for part in value.split(",") if part.strip()] or None


def _fractions(value: str) -> tuple[float, ...]:
    """`0.5,0.25` → `(0.5, 0.25)`; a clear error for anything that is not a fraction in (0, 1]."""
    out: list[float] = []
    for part in _names(value) or []:
        try:
            fraction = float(part)
        except ValueError as e:
            msg = f"--budgets: expected comma-separated fractions in (0, 1] such as 0.5,0.25, got {part!r}"
            raise ValueError(msg) from e
        out.append(fraction)
    if not out:
        msg = f"--budgets: expected comma-separated fractions in (0, 1] such as 0.5,0.25, got {value!r}"
        raise ValueError(msg)
    return tuple(out)


def _bench_engine(args: argparse.Namespace, console: Console) -> int:
    """`agentkv bench engine`: concurrent tool agents on vLLM + LMCache (see `agentkv_bench.engine`)."""
    from agentkv_bench.engine import EngineBenchSettings, run_engine_bench

    settings = EngineBenchSettings(
        vllm_url=args.vllm_url,
        coordinator_url=args.coordinator_url,
        threads=args.threads,
        turns=args.turns or 4,
        chunk_size=args.chunk_size,
        device_tokens=args.device_tokens,
        l2_quota_gb=args.l2_quota_gb,
        fleet_l2_gb=args.fleet_l2_gb,
        admission_tokens=args.admission_tokens,
        admission_quantum_turns=args.admission_quantum_turns,
    )
    out = Path(args.out) / "engine"
    summary = run_engine_bench(
        settings,
        out_dir=out,
        modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
        progress=lambda line: console.log(line),
    )
    table = Table(title=f"agentkv bench engine: {args.threads} agents ({summary['settings']})")
    for name in (
        "mode",
        "requests",
        "prompt tok",
        "computed tok",
        "vLLM hits",
        "LMCache hits",
        "p50 s",
        "p95 s",
        "req/s",
        "LMCache L1 B",
        "LMCache L2 B",
        "hint failures",
    ):
        table.add_column(name, justify="right")
    for m in summary["modes"]:
        table.add_row(
            m["mode"],
            str(m["requests"]),
            f"{m['prompt_tokens']:,.0f}",
            f"{m['computed_tokens']:,.0f}",
            f"{m['local_hits']:,.0f}",
            f"{m['lmcache_hits']:,.0f}",
            f"{m['latency_p50']:.2f}",
            f"{m['latency_p95']:.2f}",
            f"{m['requests_per_s']:.2f}",
            f"{m['lmcache_bytes'].get('l1', 0):,}",
            f"{m['lmcache_bytes'].get('l2', 0):,}",
            str(m["hint_failures"]),
        )
    console.print(table)
    console.print(
        f"prefill floor (each call reusing its previous sequence): {summary['prefill_floor']:,} tokens"
    )
    for m in summary["modes"][2:]:
        mode = m["mode"]
        console.print(
            f"computed prefill tokens, lru / {mode}: {summary[f'computed_ratio_lru_over_{mode}']:.2f}x; "
            f"vllm / {mode}: {summary[f'computed_ratio_vllm_over_{mode}']:.2f}x; "
            f"answers identical (lru vs {mode}): {summary[f'answers_identical_{mode}']}"
        )
        if m.get("gate"):
            console.print(
                f"{mode}: waits p50 / p95 {m['wait_p50']:.2f} / {m['wait_p95']:.2f} s; gate {m['gate']}"
            )
    console.print(f"results in {out}/")
    return 0


def _print_kv(title: str, data: dict[str, Any], console: Console) -> None:
    table = Table(title=title, show_header=False)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in data.items():
        table.add_row(key, f"{value:,.3f}" if isinstance(value, float) else str(value))
    console.print(table)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one bench; a user-fixable error is printed in red with exit status 2."""
    args = build_parser().parse_args(argv)
    try:
        return cmd_bench(args)
    except (CommandError, ValueError, FileNotFoundError) as e:
        Console(stderr=True).print(f"[red]agentkv bench: {escape(str(e))}[/red]")
        return 2
