"""`agentkv bench forget`: does letting the model forget stale tool results pay?

Three tool-heavy traces written for this bench (`agentkv_bench.forget_traces`: 8-9
tool calls each, some results needed by a later question, the others stale) are
replayed into one session per (trace, method, budget), with the events an agent
framework sends (tool call completed, turn ended). Then every question is asked
(completion-style, exact match, as `agentkv bench memory` asks them).

Methods, all in one run, the same `lifecycle` policy and host archive tier:

- `off`: no forgetting (the reference at each budget).
- `side-thread`: the forgetting side thread after every turn (`forget.every_turns: 1`):
  the model itself names the stale results (`agentkv.forget`).
- `oracle`: the same release path fed the trace's labels (every stale result is
  requested through `ForgetRequested`, as a perfect `forget_tool_outputs` caller
  would): what the mechanism gives when the decision is right.

Budgets: none, and fractions of the `off` run's attended tokens at its last question.

Figures per run: exact match; device tokens (peak from the session's peak device
bytes, which is sampled after every operation; mean over the samples taken after
each turn and each question); device, host and total bytes at peak; the side
thread's own cost (runs, prefill and decode tokens, wall seconds; its fork's KV
lives only during a run and is not in the session's device figures, so its size is
reported as `side_kv_tokens_max`); what it released, split by the labels
(needed / stale), malformed answers, and tokens recomputed by rehydration.
The side thread stops when the questions start (they are independent probes
of one finished conversation); the decision of the last turn is applied at the
first question's boundary.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from agentkv.backend.session import Session
from agentkv.backend.transformers import TransformersBackend
from agentkv.config import AgentKVConfig
from agentkv.forget import ForgetRequested
from agentkv.progress import ProgressCallback, report
from agentkv_bench.forget_traces import forget_traces, needed_handles
from agentkv_bench.memory import Peaks, ask, replay
from agentkv_bench.workloads import Workload

__all__ = ["FORGET_METHODS", "ForgetRun", "forget_table", "run_forget_bench"]

FORGET_METHODS: tuple[str, ...] = ("off", "side-thread", "oracle")
"""Methods `run_forget_bench` compares (see the module docstring)."""

DEFAULT_FORGET_BUDGETS: tuple[float | None, ...] = (None, 0.25)
"""No budget, and a quarter of the `off` run's attended tokens at its last question."""


@dataclass
class ForgetRun:
    """One (trace, method, budget) run."""

    trace: str
    method: str
    budget: float | None
    budget_tokens: int | None
    questions: int
    exact_match: float
    answers: dict[str, str]
    correct: dict[str, bool]
    peak_device_tokens: int
    mean_device_tokens: float
    final_device_tokens: int
    peak_device_bytes: int
    peak_host_bytes: int
    peak_total_bytes: int
    """Largest device + host bytes at one sample (or the device peak alone, when larger)."""
    prefill_tokens: int
    """Tokens the main session encoded (rehydration included)."""
    rehydrated_tokens: int
    side_runs: int
    side_prefill_tokens: int
    side_decode_tokens: int
    side_seconds: float
    side_kv_tokens_max: int
    """The largest fork KV of one side-thread run (prefilled + decoded tokens of its own)."""
    malformed: int
    released: int
    released_needed: int
    released_stale: int
    stale_total: int
    wall_seconds: float
    decisions: list[dict[str, Any]] = field(default_factory=list)
    device_tokens_by_step: list[tuple[str, int]] = field(default_factory=list)


def _config(method: str, budget_tokens: int | None) -> AgentKVConfig:
    data: dict[str, Any] = {"policy": "lifecycle", "budget": {"device_tokens": budget_tokens}}
    if method == "side-thread":
        data["forget"] = {"enabled": True, "every_turns": 1}
    return AgentKVConfig.from_dict(data)


def _oracle_request(session: Session, labels: dict[str, bool], turn: int) -> None:
    """At a turn end, request every stale result seen so far (the guard rails still apply)."""
    seen = {handle for handle, _ in session.forget.tool_results()}
    stale = tuple(h for h, needed in labels.items() if not needed and h in seen)
    if stale:
        session.apply(ForgetRequested(handles=stale, source="oracle", request_id=f"oracle-{turn}"))


def run_one(
    backend: TransformersBackend,
    trace: Workload,
    method: str,
    *,
    budget: float | None,
    budget_tokens: int | None,
) -> tuple[ForgetRun, int]:
    """Replay one trace with one method, ask its questions; return the run and the final attended tokens."""
    started = time.perf_counter()
    session = backend.session(f"{trace.name}:{method}:{budget}")
    labels = needed_handles(trace)
    bpt = backend.runner.bytes_per_token
    peaks = Peaks()

    def on_step(step: str) -> None:
        if method == "oracle":
            _oracle_request(session, labels, session.turn)
        peaks.sample(session, step)

    history = replay(session, trace, events=True, on_step=on_step)
    session.forget.enabled = False  # questions are probes of the finished conversation
    answers: dict[str, str] = {}
    correct: dict[str, bool] = {}
    attended = 0
    for question in trace.questions:
        result = ask(session, history, question)
        answers[question.id] = result.answer
        correct[question.id] = result.exact_match
        attended = result.attended_tokens
        peaks.sample(session, f"q:{question.id}")
    stats = session.stats()
    forget = session.forget.stats
    steps = [(sample.step, sample.attended_tokens) for sample in peaks.samples]
    applied = _released_handles(session)
    run = ForgetRun(
        trace=trace.name,
        method=method,
        budget=budget,
        budget_tokens=budget_tokens,
        questions=len(trace.questions),
        exact_match=sum(correct.values()) / max(1, len(correct)),
        answers=answers,
        correct=correct,
        peak_device_tokens=max(stats.peak_device_bytes // bpt, max((t for _, t in steps), default=0)),
        mean_device_tokens=sum(t for _, t in steps) / max(1, len(steps)),
        final_device_tokens=stats.attended_tokens,
        peak_device_bytes=stats.peak_device_bytes,
        peak_host_bytes=peaks.host,
        peak_total_bytes=max(peaks.total, stats.peak_device_bytes),
        prefill_tokens=stats.prefill_tokens,
        rehydrated_tokens=stats.rehydrated_tokens,
        side_runs=forget.runs,
        side_prefill_tokens=forget.prefill_tokens,
        side_decode_tokens=forget.decode_tokens,
        side_seconds=forget.seconds,
        side_kv_tokens_max=max((d.prefill_tokens + d.decode_tokens for d in forget.decisions), default=0),
        malformed=forget.malformed,
        released=len(applied),
        released_needed=sum(1 for h in applied if labels.get(h)),
        released_stale=sum(1 for h in applied if not labels.get(h, True)),
        stale_total=sum(1 for needed in labels.values() if not needed),
        wall_seconds=time.perf_counter() - started,
        decisions=[
            {
                "turn": d.turn,
                "trigger": d.trigger,
                "offered": list(d.offered),
                "chosen": list(d.chosen),
                "refused": [list(r) for r in d.refused],
                "malformed": d.malformed,
                "answer": d.answer,
                "prefill_tokens": d.prefill_tokens,
                "decode_tokens": d.decode_tokens,
                "seconds": d.seconds,
            }
            for d in forget.decisions
        ],
        device_tokens_by_step=steps,
    )
    backend.close(session.session_id)
    return run, attended


def _released_handles(session: Session) -> list[str]:
    """Handles whose results a forget decision released (applied at a boundary)."""
    forgotten = session.forget.forgotten
    return [handle for handle, span in session.forget.tool_results() if span.span_id in forgotten]


def run_forget_bench(
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    budgets: Sequence[float | None] = DEFAULT_FORGET_BUDGETS,
    methods: Sequence[str] = FORGET_METHODS,
    out_dir: str | Path = "runs/forget",
    progress: ProgressCallback | None = None,
) -> dict[str, Any]:
    """Run every (trace, method, budget); write `forget.json` under `out_dir`; return the document."""
    unknown = [m for m in methods if m not in FORGET_METHODS]
    if unknown:
        msg = f"unknown method(s) {unknown}; allowed: {', '.join(FORGET_METHODS)}"
        raise ValueError(msg)
    bad = [b for b in budgets if b is not None and not 0 < b <= 1]
    if bad:
        msg = f"budgets must be None or fractions in (0, 1], got {bad}"
        raise ValueError(msg)
    started = time.perf_counter()
    traces = forget_traces()
    runs: list[ForgetRun] = []
    info: list[dict[str, Any]] = []
    order = ["off", *(m for m in methods if m != "off")]
    total = len(traces) * len(order) * len(budgets)
    done = 0
    for trace in traces:
        off, full_tokens = run_one(
            TransformersBackend(model, tokenizer, _config("off", None)),
            trace,
            "off",
            budget=None,
            budget_tokens=None,
        )
        labels = needed_handles(trace)
        info.append(
            {
                "name": trace.name,
                "title": trace.title,
                "turns": len(trace.turns),
                "tool_results": len(labels),
                "stale": [h for h, needed in labels.items() if not needed],
                "questions": len(trace.questions),
                "full_tokens": full_tokens,
            }
        )
        for budget in budgets:
            tokens = None if budget is None else max(1, round(budget * full_tokens))
            for method in order:
                if method == "off" and budget is None:
                    run = off
                else:
                    backend = TransformersBackend(model, tokenizer, _config(method, tokens))
                    run, _ = run_one(backend, trace, method, budget=budget, budget_tokens=tokens)
                runs.append(run)
                done += 1
                report(progress, "bench forget", done, total, _detail(run))
    summary = summarise(runs)
    result: dict[str, Any] = {
        "config": {
            "budgets": list(budgets),
            "methods": order,
            "model": getattr(getattr(model, "config", None), "name_or_path", None) or type(model).__name__,
            "side_thread": "forget.every_turns=1, default prompt and max_candidates; "
            "rule custom:forget_tool_output=evict",
            "torch_threads": torch.get_num_threads(),
        },
        "traces": info,
        "runs": [asdict(r) for r in runs],
        "summary": summary,
        "wall_seconds": time.perf_counter() - started,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "forget.json").write_text(json.dumps(result, indent=2))
    return result


def _detail(run: ForgetRun) -> str:
    budget = "" if run.budget is None else f" @{run.budget:g}"
    return (
        f"{run.trace} {run.method}{budget}: EM {100 * run.exact_match:.0f}%, "
        f"peak {run.peak_device_tokens} tok, released {run.released} ({run.released_needed} needed)"
    )


def summarise(runs: Sequence[ForgetRun]) -> list[dict[str, Any]]:
    """One row per (method, budget), pooled over traces (EM over all questions; tokens averaged)."""
    rows: list[dict[str, Any]] = []
    keys = list(dict.fromkeys((r.method, r.budget) for r in runs))
    for method, budget in keys:
        group = [r for r in runs if r.method == method and r.budget == budget]
        n = len(group)
        questions = sum(r.questions for r in group)
        rows.append(
            {
                "method": method,
                "budget": budget,
                "traces": n,
                "exact_match_pct": 100.0
                * sum(r.exact_match * r.questions for r in group)
                / max(1, questions),
                "peak_device_tokens": sum(r.peak_device_tokens for r in group) / n,
                "mean_device_tokens": sum(r.mean_device_tokens for r in group) / n,
                "peak_device_bytes": sum(r.peak_device_bytes for r in group) / n,
                "peak_host_bytes": sum(r.peak_host_bytes for r in group) / n,
                "peak_total_bytes": sum(r.peak_total_bytes for r in group) / n,
                "rehydrated_tokens": sum(r.rehydrated_tokens for r in group),
                "side_runs": sum(r.side_runs for r in group),
                "side_prefill_tokens": sum(r.side_prefill_tokens for r in group),
                "side_decode_tokens": sum(r.side_decode_tokens for r in group),
                "side_seconds": sum(r.side_seconds for r in group),
                "malformed": sum(r.malformed for r in group),
                "released": sum(r.released for r in group),
                "released_needed": sum(r.released_needed for r in group),
                "released_stale": sum(r.released_stale for r in group),
                "stale_total": sum(r.stale_total for r in group),
            }
        )
    return rows


def forget_table(result: dict[str, Any]) -> Any:
    """A rich table of the summary: one row per (method, budget), pooled over the traces."""
    from rich.table import Table

    traces = ", ".join(t["name"] for t in result["traces"])
    table = Table(title=f"agentkv bench forget ({traces}; budgets are fractions of the off run's cache)")
    columns = (
        "method",
        "budget",
        "EM %",
        "peak dev tok",
        "mean dev tok",
        "peak dev/host/total MiB",
        "released (needed/stale of stale)",
        "rehydrated tok",
        "side runs",
        "side prefill+decode tok",
        "side s",
        "malformed",
    )
    for name in columns:
        table.add_column(name, justify="left" if name == "method" else "right")
    mib = 2**20
    for row in result["summary"]:
        budget = "none" if row["budget"] is None else f"{100 * row['budget']:g}%"
        table.add_row(
            row["method"],
            budget,
            f"{row['exact_match_pct']:.1f}",
            f"{row['peak_device_tokens']:.0f}",
            f"{row['mean_device_tokens']:.0f}",
            f"{row['peak_device_bytes'] / mib:.1f}/{row['peak_host_bytes'] / mib:.1f}/"
            f"{row['peak_total_bytes'] / mib:.1f}",
            f"{row['released']} ({row['released_needed']}/{row['released_stale']} of {row['stale_total']})",
            str(row["rehydrated_tokens"]),
            str(row["side_runs"]),
            f"{row['side_prefill_tokens']}+{row['side_decode_tokens']}",
            f"{row['side_seconds']:.1f}",
            str(row["malformed"]),
        )
    return table
