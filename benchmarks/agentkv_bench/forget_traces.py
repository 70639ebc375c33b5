"""Tool-heavy traces for `agentkv bench forget`, written fresh for it.

Each trace is a scripted agent conversation in the JSON shape of
`agentkv_bench.workloads`, stored next to this module in `forget_workloads/`: six
turns (fewer than the memory bench's workloads), two tool calls in most of them.
Some results hold a fact a later question asks about ("needed"); the others are
stale by construction: a weather check, a currency conversion, a failed or
superseded search, a log dump that led nowhere.
A tool result is *needed* exactly when some question's gold answer occurs in it
(`needed_handles`), so the labels cannot drift from the questions.

Questions are completion-style (the prefix quotes the words before the fact in the
tool result), as the default 135M model needs; the phrasings were checked against
the full-cache run only.
"""

from __future__ import annotations

import json
from pathlib import Path

from agentkv_bench.workloads import Workload, parse_workload

__all__ = ["FORGET_TRACES", "forget_traces", "needed_handles"]

FORGET_TRACE_DIR = Path(__file__).with_name("forget_workloads")
"""Where the traces' JSON files live."""

FORGET_TRACES: tuple[str, ...] = ("apartment", "incident", "research")
"""The traces, in report order."""

MIN_TRACE_TURNS = 6
"""The fewest turns a trace has (the memory bench's workloads have more)."""


def forget_traces() -> list[Workload]:
    """The three traces, in a fixed order (validated like every workload)."""
    return [
        parse_workload(
            json.loads((FORGET_TRACE_DIR / f"{name}.json").read_text(encoding="utf-8")),
            where=name,
            min_turns=MIN_TRACE_TURNS,
        )
        for name in FORGET_TRACES
    ]


def needed_handles(workload: Workload) -> dict[str, bool]:
    """For each tool result's handle (`T1` = the first), whether a question's gold answer is in it."""
    out: dict[str, bool] = {}
    k = 0
    for turn in workload.turns:
        for tool in turn.tools:
            k += 1
            out[f"T{k}"] = any(q.gold in tool.result for q in workload.questions)
    return out
