"""The `agentkv` command: `demo`, `bench reuse|memory|soak|forget|threads|tools|calls`, `inspect`.

Library code reports progress through callbacks (`agentkv.progress`); this module is
where it becomes visible: rich progress bars on stderr while the model loads (its
first-load conversion) and while benchmarks run, off when stderr is not a terminal or
with `--no-progress`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from agentkv.progress import ProgressStep

logger = logging.getLogger("agentkv.cli")

AGENTS_EXTRA_HINT = "pip install 'agentkv-lifecycle[agents]'"
"""How to get the optional LangChain / LangGraph dependencies the demo agent needs."""


class CommandError(Exception):
    """A failure the user can fix (missing extra, bad model path): printed in red, exit status 2."""


class RichProgress:
    """A `ProgressCallback` that draws one rich bar per task on stderr.

    Use it as a context manager around the work. The bars are transient (they vanish
    when done) and drawn only when `enabled` and stderr is a terminal; with
    `log_details`, each step's `detail` is also printed as a line (kept in logs).
    """

    def __init__(self, *, enabled: bool = True, log_details: bool = False, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self.log_details = log_details
        self.bars = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[detail]}"),
            console=self.console,
            transient=True,
            disable=not (enabled and self.console.is_terminal),
        )
        self.tasks: dict[str, TaskID] = {}

    def __enter__(self) -> RichProgress:
        self.bars.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.bars.stop()

    def __call__(self, step: ProgressStep) -> None:
        """Move the step's task bar (created on its first step)."""
        task = self.tasks.get(step.task)
        if task is None:
            task = self.tasks[step.task] = self.bars.add_task(step.task, total=step.total, detail="")
        self.bars.update(task, completed=step.done, total=step.total, detail=step.detail)
        if self.log_details and step.detail:
            self.console.log(str(step))


def _progress(args: argparse.Namespace, *, log_details: bool = False) -> RichProgress:
    return RichProgress(enabled=not args.no_progress, log_details=log_details)


def _load(args: argparse.Namespace, config: Any = None) -> tuple[Any, Any]:
    """The model named by `--model`, else by the config, else the default; with a progress bar."""
    from transformers.utils import logging as hf_logging

    from agentkv.models import ModelLoadError, load_model

    # Our bar covers the load; Transformers' own per-tensor bar would print even into a pipe.
    hf_logging.disable_progress_bar()
    name = args.model or (config.model if config is not None else None)
    device = getattr(args, "device", None) or (config.device if config is not None else None)
    dtype = config.dtype if config is not None else None
    kernel = config.attn_implementation if config is not None else None
    try:
        with _progress(args) as bars:
            return load_model(name, device=device, dtype=dtype, progress=bars, attn_implementation=kernel)
    except ModelLoadError as e:
        raise CommandError(str(e)) from e


def _config(path: str | None) -> Any:
    from agentkv.config import AgentKVConfig

    return AgentKVConfig.from_yaml(path) if path else AgentKVConfig()


def cmd_demo(args: argparse.Namespace) -> int:
    """`agentkv demo`: the tool agent with and without agentkv (`agentkv_langgraph.demo`)."""
    config = _config(args.config)  # a bad --config fails before anything slow
    from agentkv.demo import demo_config

    demo_config(config, args.budget)  # so does a bad --budget
    try:
        from agentkv_langgraph.demo import run_demo
    except ImportError as e:
        msg = (
            f"agentkv demo runs a LangGraph agent and needs the agents extra ({e}); "
            f"install it with: {AGENTS_EXTRA_HINT}"
        )
        raise CommandError(msg) from e
    model, tokenizer = _load(args, config)
    run_demo(
        model,
        tokenizer,
        config=config,
        turns=args.turns,
        budget_tokens=args.budget,
        max_new_tokens=args.max_new_tokens,
        out_dir=args.out,
    )
    return 0


def _print_kv(title: str, data: dict[str, Any], console: Console) -> None:
    table = Table(title=title, show_header=False)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in data.items():
        table.add_row(key, f"{value:,.3f}" if isinstance(value, float) else str(value))
    console.print(table)


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
    model, tokenizer = _load(args)
    out = Path(args.out) / args.which
    if args.which == "reuse":
        from agentkv.bench.reuse import run_reuse_bench

        with _progress(args) as bars:
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
        from agentkv.bench.memory import acceptance_line, memory_table, run_memory_bench

        with _progress(args, log_details=True) as bars:
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
        from agentkv.bench.forget import forget_table, run_forget_bench

        forget_budgets: tuple[float | None, ...] = (0.25,) if args.quick else (None, 0.25)
        with _progress(args) as bars:
            result = run_forget_bench(model, tokenizer, budgets=forget_budgets, out_dir=out, progress=bars)
        console.print(forget_table(result))
    elif args.which == "threads":
        from agentkv.bench.threads import run_threads_bench

        counts = tuple(int(n) for n in _names(args.counts) or ["1", "8", "32"])
        with _progress(args) as bars:
            result = run_threads_bench(
                model, tokenizer, counts=counts, turns=args.turns or 3, out_dir=out, progress=bars
            )
        console.print(_threads_table(result))
    elif args.which == "tools":
        try:
            from agentkv_langchain.tool_bench import run_tools_bench, tools_table
        except ImportError as e:
            msg = f"agentkv bench tools needs LangChain and LangGraph: {AGENTS_EXTRA_HINT} ({e})"
            raise CommandError(msg) from e
        with _progress(args) as bars:
            result = run_tools_bench(model, tokenizer, out_dir=out, progress=bars)
        console.print(tools_table(result))
    elif args.which == "calls":
        try:
            from agentkv_langchain.call_bench import calls_table, run_calls_bench
        except ImportError as e:
            msg = f"agentkv bench calls needs LangChain: {AGENTS_EXTRA_HINT} ({e})"
            raise CommandError(msg) from e
        calls_budgets = _fractions(args.budgets) if args.budgets else (0.25, 0.125)
        with _progress(args) as bars:
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
        from agentkv.bench.soak import run_soak

        with _progress(args) as bars:
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
    """`agentkv bench engine`: concurrent tool agents on vLLM + LMCache (see `agentkv.bench.engine`)."""
    from agentkv.bench.engine import EngineBenchSettings, run_engine_bench

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


def cmd_inspect(args: argparse.Namespace) -> int:
    """`agentkv inspect SNAPSHOT`."""
    from agentkv.inspection import plot_span_strip, print_inspection

    print_inspection(args.snapshot)
    if args.png:
        console = Console()
        console.print(f"wrote {plot_span_strip(args.snapshot, args.png)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (its `--help` is the CLI reference)."""
    parser = argparse.ArgumentParser(
        prog="agentkv",
        description="KV-cache lifecycle middleware for agents on local Transformers models.",
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="-v info logs, -vv debug (one per transition)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    progress = argparse.ArgumentParser(add_help=False)
    progress.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bars (drawn on stderr, and only when it is a terminal)",
    )

    demo = sub.add_parser(
        "demo",
        help="run the tool-using LangGraph agent with and without agentkv, side by side",
        parents=[progress],
        description=(
            "Runs the tool-using LangGraph agent (model <-> tools, 12 scripted user turns, forced tool "
            "calls) twice on one model: with the KV lifecycle (ChatAgentKV + with_kv_lifecycle + a device "
            "budget) and with a full cache re-encoded on every model call (a stateless model, like "
            "ChatHuggingFace). A live table shows each turn: model calls, tokens prefilled and reused, "
            "time to first token, device / quantized / host KV bytes, tokens per span state, the events "
            "applied and the span moves. Then both runs answer recall questions about early facts; the "
            "summary compares memory, TTFT, prefill and the answers. Writes demo.json, device_bytes.png, "
            "spans.png and session.json. Needs the agents extra: " + AGENTS_EXTRA_HINT + "."
        ),
    )
    demo.add_argument(
        "--model",
        help="HF id, model directory or .gguf path (default: the config's model, else SmolLM2-135M-Instruct)",
    )
    demo.add_argument(
        "--budget",
        type=int,
        help="the agentkv run's per-session device KV budget in tokens; 0 = unlimited "
        "(default: the --config file's device budget, else 512)",
    )
    demo.add_argument(
        "--config",
        metavar="GRAPH_YAML",
        help="a graph YAML whose `agentkv:` section sets the agentkv run (policy, archive tier, budget, "
        "rules; see examples/graph.yaml)",
    )
    demo.add_argument(
        "--turns", type=int, default=12, help="scripted user turns per run (default 12; the script repeats)"
    )
    demo.add_argument(
        "--max-new-tokens", type=int, default=24, help="tokens per model call's answer (default 24)"
    )
    demo.add_argument(
        "--out",
        default="agentkv-out",
        metavar="DIR",
        help="folder for demo.json, device_bytes.png, spans.png, session.json (default agentkv-out)",
    )
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser(
        "bench", help="benchmarks that print tables and write JSON + PNG", parents=[progress]
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
    bench.set_defaults(func=cmd_bench)

    inspect = sub.add_parser("inspect", help="render a session snapshot (JSON from session.save_snapshot)")
    inspect.add_argument("snapshot", help="path to a snapshot JSON file")
    inspect.add_argument("--png", help="also write the span strip PNG here")
    inspect.set_defaults(func=cmd_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `agentkv` command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except (CommandError, ValueError, FileNotFoundError) as e:
        Console(stderr=True).print(f"[red]agentkv: {escape(str(e))}[/red]")
        return 2


if __name__ == "__main__":
    sys.exit(main())
