"""The `agentkv` command: `demo`, `bench reuse|memory|soak`, `inspect`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

logger = logging.getLogger("agentkv.cli")


def _load(args: argparse.Namespace, config: Any = None) -> tuple[Any, Any]:
    from agentkv.models import load_model

    name = args.model or (config.model if config is not None else None)
    device = getattr(args, "device", None) or (config.device if config is not None else None)
    dtype = config.dtype if config is not None else None
    return load_model(name, device=device, dtype=dtype)


def _config(path: str | None) -> Any:
    from agentkv.config import AgentKVConfig

    return AgentKVConfig.from_yaml(path) if path else AgentKVConfig()


def cmd_demo(args: argparse.Namespace) -> int:
    """`agentkv demo`."""
    from agentkv.demo import run_demo

    config = _config(args.config)
    model, tokenizer = _load(args, config)
    budget = None if args.budget in (None, 0) else args.budget
    if config.budget.limited and args.budget is not None:
        config = config.with_overrides({"budget": {"device_tokens": args.budget, "device_bytes": None}})
    run_demo(
        model,
        tokenizer,
        config=config,
        turns=args.turns,
        budget_tokens=budget,
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
    """`agentkv bench reuse|memory|soak`."""
    console = Console()
    model, tokenizer = _load(args)
    out = Path(args.out) / args.which
    if args.which == "reuse":
        from agentkv.bench.reuse import run_reuse_bench

        result = run_reuse_bench(
            model, tokenizer, turns=args.turns or 22, out_dir=out, progress=lambda m: console.log(m)
        )
        table = Table(title="agentkv bench reuse: per turn (reuse | re-encode)")
        for name in (
            "turn",
            "history",
            "prefill reuse",
            "prefill re-enc",
            "TTFT reuse ms",
            "TTFT re-enc ms",
            "decode tok/s reuse",
            "decode tok/s re-enc",
        ):
            table.add_column(name, justify="right")
        for a, b in zip(result["reuse"], result["reencode"], strict=True):
            table.add_row(
                str(a["turn"]),
                str(a["history_tokens"]),
                str(a["prefill_tokens"]),
                str(b["prefill_tokens"]),
                f"{a['ttft_s'] * 1000:,.0f}",
                f"{b['ttft_s'] * 1000:,.0f}",
                f"{a['decode_tok_s']:.1f}",
                f"{b['decode_tok_s']:.1f}",
            )
        console.print(table)
        summary = dict(result["summary"])
        decode = summary.pop("decode")
        _print_kv("totals", summary, console)
        _print_kv("decode loop vs model.generate (same full cache)", decode, console)
    elif args.which == "memory":
        from agentkv.bench.memory import run_memory_bench

        budgets = (0.25,) if args.quick else (0.5, 0.25, 0.125)
        run_memory_bench(model, tokenizer, budgets=budgets, out_dir=out, progress=lambda m: console.log(m))
    elif args.which == "soak":
        from agentkv.bench.soak import run_soak

        summary = run_soak(model, tokenizer, turns=args.turns or 300, out_dir=out)
        _print_kv("soak", summary, console)
    console.print(f"results in {out}/")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    """`agentkv inspect SNAPSHOT`."""
    from agentkv.inspect import plot_span_strip, print_inspection

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

    demo = sub.add_parser("demo", help="run the tool-using agent with and without agentkv, side by side")
    demo.add_argument("--model", help="HF id, model directory or .gguf path (default: SmolLM2-135M-Instruct)")
    demo.add_argument(
        "--budget",
        type=int,
        default=512,
        help="per-session device KV budget in tokens (0 = unlimited; default 512)",
    )
    demo.add_argument("--config", help="a graph YAML file with an `agentkv:` section")
    demo.add_argument("--turns", type=int, default=12, help="user turns to run (default 12)")
    demo.add_argument("--max-new-tokens", type=int, default=16, help="tokens per answer (default 16)")
    demo.add_argument(
        "--out", default="agentkv-out", help="folder for demo.json and the PNGs (default agentkv-out)"
    )
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="benchmarks that print tables and write JSON + PNG")
    bench.add_argument(
        "which",
        choices=["reuse", "memory", "soak"],
        help="reuse: session reuse vs re-encoding; memory: fidelity vs device budget; soak: 300+ turns",
    )
    bench.add_argument(
        "--model", help="HF id, model directory or .gguf path (default: SmolLM2-135M-Instruct)"
    )
    bench.add_argument("--turns", type=int, help="turns (reuse: 22, soak: 300)")
    bench.add_argument("--quick", action="store_true", help="memory: only the 25%% budget")
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
    except (ValueError, FileNotFoundError) as e:
        Console(stderr=True).print(f"[red]agentkv: {e}[/red]")
        return 2


if __name__ == "__main__":
    sys.exit(main())
