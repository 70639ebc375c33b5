"""`agentkv bench threads`: N agent threads that start with the same system prompt and tools block.

Every thread of a tool agent starts with the same 1k+-token system prompt (the
instructions and the tool descriptions). Without sharing, each thread encodes it
on its first call and holds its own copy; with the backend's prefix cache the
first thread encodes it once and the others attend it.

For each N, two runs on one model: `shared` (prefix cache on, the default) and
`unshared` (off). Threads make their first calls one after another, then take
their follow-up turns (a tool call and its result, an answer) round robin. The
figures: first-call time to first token of threads 2..N against a follow-up
turn's, tokens prefilled in all, device KV bytes at the end (shared tensors
counted once, what `backend.device_bytes()` reports), and whether every answer
is the same with and without sharing (greedy decoding).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from agentkv.backend.transformers import TransformersBackend
from agentkv.config import AgentKVConfig
from agentkv.progress import ProgressCallback, report
from agentkv_bench.reuse import timed_answer

__all__ = ["ThreadsRun", "run_threads_bench", "system_prompt", "threads_rows"]

_TOOLS = [
    ("weather", "city, date", "the forecast: temperature range, rain probability, wind and humidity"),
    ("flights", "origin, destination, date", "direct and one-stop flights with times, carriers and fares"),
    ("trains", "origin, destination, date", "rail connections with platforms, changes and seat classes"),
    ("hotels", "city, check_in, nights", "rooms with nightly rates, cancellation terms and distance"),
    ("museums", "city", "opening hours, closing days, ticket prices and current exhibitions"),
    ("ferries", "port, date", "sailings with departure times, crossing duration and vehicle space"),
    ("visa_rules", "nationality, country", "entry requirements, allowed stay and documents to carry"),
    ("currency", "amount, from, to", "the converted amount at today's mid-market rate"),
    ("restaurants", "city, cuisine", "places with price level, opening hours and reservation links"),
    ("car_rental", "city, pick_up, days", "vehicles with daily rates, deposit and insurance options"),
    ("events", "city, date", "concerts, festivals and matches with venues and ticket availability"),
    ("translate", "text, language", "the text translated, with a pronunciation hint"),
]


def system_prompt() -> str:
    """The shared system prompt: instructions plus a tools block (~1.1k tokens on SmolLM2)."""
    lines = [
        "You are a careful travel-and-logistics assistant working for many customers at once.",
        "Answer briefly. When you need a fact, call exactly one tool by writing its name and",
        "arguments as JSON; wait for its result before answering. Never invent prices or times.",
        "Remember what the customer told you earlier in the conversation and confirm bookings.",
        "",
        "Tools:",
    ]
    for name, args, returns in _TOOLS:
        names = [a.strip() for a in args.split(",")]
        params = ", ".join(
            f'"{a}": {{"type": "string", "description": "the {a.replace("_", " ")}"}}' for a in names
        )
        required = ", ".join(f'"{a}"' for a in names)
        schema = f'{{"name": "{name}", "parameters": {{"type": "object", "properties": {{{params}}}, '
        schema += f'"required": [{required}]}}}}'
        lines.append(
            f"- {name}({args}): returns {returns}. Schema: {schema}. "
            f"Use {name} only when the customer asks about it; quote its figures exactly."
        )
    lines += [
        "",
        "Rules: one tool call per turn; if a tool fails, say so and offer an alternative; keep",
        "personal data out of tool arguments unless the customer asked for a booking.",
    ]
    return "\n".join(lines)


def _first_message(i: int) -> dict[str, Any]:
    return {
        "role": "user",
        "content": f"Customer {i}: I am planning a trip to city {i % 7}. What should I know?",
    }


def _tool_turn(messages: list[dict[str, Any]], i: int, k: int) -> None:
    """Append one follow-up turn: a question, the tool call and its result."""
    call = f"call-{i}-{k}"
    tool = _TOOLS[(i + k) % len(_TOOLS)][0]
    messages += [
        {"role": "user", "content": f"Customer {i}, step {k}: please check {tool} for me."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": call, "name": tool, "args": {"city": f"c{i}"}}],
        },
        {
            "role": "tool",
            "content": f"{tool} result for customer {i}: ok, code {1000 * i + k}.",
            "tool_call_id": call,
        },
    ]


@dataclass(frozen=True)
class ThreadsRun:
    """One run: N threads, sharing on or off."""

    threads: int
    shared: bool
    first_ttft_s: list[float]
    """Per thread, time to first token of its first call."""
    followup_ttft_s: list[float]
    """Every follow-up turn's time to first token."""
    prefill_tokens: int
    """Tokens encoded by the model, all threads, all turns."""
    shared_prefix_tokens: int
    """Tokens threads took from the prefix cache instead of encoding them."""
    device_bytes: int
    """Device KV bytes at the end, all threads and the prefix cache, shared tensors counted once."""
    prefix_bytes: int
    """Of `device_bytes`, the prefix cache's entries."""
    answers: list[list[str]]
    """Per thread, its answers in order."""


def _run(
    model: Any, tokenizer: Any, n: int, turns: int, shared: bool, max_new_tokens: int, system_text: str
) -> ThreadsRun:
    # Policy `full`: no budget demotes anything, so the runs differ only by sharing.
    config = AgentKVConfig.from_dict({"policy": "full", "prefix_cache": {"enabled": shared}})
    backend = TransformersBackend(model, tokenizer, config)
    system = {"role": "system", "content": system_text}
    histories = [[system, _first_message(i)] for i in range(n)]
    sessions = [backend.session(f"thread-{i}") for i in range(n)]
    answers: list[list[str]] = [[] for _ in range(n)]
    first: list[float] = []
    followup: list[float] = []
    for i, session in enumerate(sessions):
        row = timed_answer(session, histories[i], max_new_tokens)
        first.append(row.ttft_s)
        answers[i].append(row.answer)
        histories[i].append({"role": "assistant", "content": row.answer})
    for k in range(turns - 1):
        for i, session in enumerate(sessions):
            _tool_turn(histories[i], i, k)
            row = timed_answer(session, histories[i], max_new_tokens)
            followup.append(row.ttft_s)
            answers[i].append(row.answer)
            histories[i].append({"role": "assistant", "content": row.answer})
    stats = [s.stats() for s in sessions]
    cache = backend.prefix_cache
    return ThreadsRun(
        threads=n,
        shared=shared,
        first_ttft_s=first,
        followup_ttft_s=followup,
        prefill_tokens=sum(st.prefill_tokens for st in stats),
        shared_prefix_tokens=sum(st.shared_prefix_tokens for st in stats),
        device_bytes=backend.device_bytes(),
        prefix_bytes=0 if cache is None else cache.held_bytes(),
        answers=answers,
    )


def threads_rows(runs: list[ThreadsRun]) -> list[dict[str, Any]]:
    """One row per N: both runs side by side."""
    rows: list[dict[str, Any]] = []
    for n in sorted({r.threads for r in runs}):
        on = next(r for r in runs if r.threads == n and r.shared)
        off = next(r for r in runs if r.threads == n and not r.shared)
        later_on = on.first_ttft_s[1:] or on.first_ttft_s
        followup = statistics.median(on.followup_ttft_s) if on.followup_ttft_s else float("nan")
        rows.append(
            {
                "threads": n,
                "first_call_ttft_s_thread1": on.first_ttft_s[0],
                "first_call_ttft_s_threads2N_shared": statistics.median(later_on),
                "first_call_ttft_s_threads2N_unshared": statistics.median(
                    off.first_ttft_s[1:] or off.first_ttft_s
                ),
                "followup_ttft_s_shared": followup,
                "first_call_over_followup": statistics.median(later_on) / followup
                if followup
                else float("nan"),
                "prefill_tokens_shared": on.prefill_tokens,
                "prefill_tokens_unshared": off.prefill_tokens,
                "shared_prefix_tokens": on.shared_prefix_tokens,
                "device_bytes_shared": on.device_bytes,
                "device_bytes_unshared": off.device_bytes,
                "prefix_bytes": on.prefix_bytes,
                "answers_identical": on.answers == off.answers,
            }
        )
    return rows


def run_threads_bench(
    model: Any,
    tokenizer: Any,
    *,
    counts: tuple[int, ...] = (1, 8, 32),
    turns: int = 3,
    max_new_tokens: int = 8,
    system: str | None = None,
    out_dir: Path | None = None,
    progress: ProgressCallback | None = None,
) -> dict[str, Any]:
    """Run every N with sharing on and off; returns (and writes) `{"rows", "runs", "settings"}`.

    `system`: the shared system prompt (None = `system_prompt()`, ~1.1k tokens on SmolLM2).
    """
    system_text = system_prompt() if system is None else system
    if any(n < 1 for n in counts) or turns < 1:
        msg = f"threads bench: thread counts and turns must be >= 1, got counts={counts}, turns={turns}"
        raise ValueError(msg)
    prompt_tokens = len(tokenizer(system_text)["input_ids"])
    runs: list[ThreadsRun] = []
    total = 2 * len(counts)
    settings = {
        "counts": list(counts),
        "turns": turns,
        "max_new_tokens": max_new_tokens,
        "system_prompt_tokens": prompt_tokens,
        "torch_threads": torch.get_num_threads(),
    }
    result: dict[str, Any] = {}
    for n in counts:
        for shared in (True, False):
            report(progress, "threads", len(runs), total, f"N={n} {'shared' if shared else 'unshared'}")
            with torch.inference_mode():
                runs.append(_run(model, tokenizer, n, turns, shared, max_new_tokens, system_text))
        # Written after every N: a long run that is stopped keeps the counts it finished.
        result = {"settings": settings, "rows": threads_rows(runs), "runs": [asdict(r) for r in runs]}
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "threads.json").write_text(json.dumps(result, indent=2))
    report(progress, "threads", total, total)
    return result
