"""The `agentkv` command: `demo`, `bench …` (the `agentkv-bench` distribution), `inspect`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape

from agentkv.cli_common import AGENTS_EXTRA_HINT, BENCH_HINT, CommandError, load_for_command

logger = logging.getLogger("agentkv.cli")


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
    model, tokenizer = load_for_command(args, config)
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

    sub.add_parser(
        "bench",
        add_help=False,
        help="benchmarks that print tables and write JSON + PNG (`agentkv bench --help`)",
    )
    inspect = sub.add_parser("inspect", help="render a session snapshot (JSON from session.save_snapshot)")
    inspect.add_argument("snapshot", help="path to a snapshot JSON file")
    inspect.add_argument("--png", help="also write the span strip PNG here")
    inspect.set_defaults(func=cmd_inspect)
    return parser


def _bench(argv: list[str], *, verbose: int) -> int:
    """`agentkv bench ARGS`: hand ARGS to the benchmark package, which installs apart from the core."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        from agentkv_bench.cli import main as bench_main
    except ImportError as e:
        msg = f"agentkv bench needs the benchmark package ({e}); install it with: {BENCH_HINT}"
        Console(stderr=True).print(f"[red]agentkv: {escape(msg)}[/red]")
        return 2
    return bench_main(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `agentkv` command."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        return _bench(rest, verbose=args.verbose)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except (CommandError, ValueError, FileNotFoundError) as e:
        Console(stderr=True).print(f"[red]agentkv: {escape(str(e))}[/red]")
        return 2


if __name__ == "__main__":
    sys.exit(main())
