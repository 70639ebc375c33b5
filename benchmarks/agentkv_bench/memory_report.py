"""Rows, summaries and presentation of `agentkv bench memory` (no model needed).

Memory is always reported per tier and in total, because a method that keeps a
quarter of the cache on the device and the rest on the host has not saved three
quarters of the memory, it has moved them:

- *device* = full-precision attended KV + quantized KV (both live on the
  accelerator; the device budget counts both);
- *host* = KV offloaded to CPU memory (recallable);
- *total* = device + host.

Each is reported at its peak over the run and *at answer time* (after a question
is encoded, the cache the answer is generated from, averaged over questions),
next to the tokens recomputed by rehydration (`rehydrated_tokens`: evicted spans
encoded again from their token ids) and restored from the host.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from agentkv.metrics import SessionStats
from agentkv_bench.methods import BASELINES, METHODS, SUITES
from agentkv_bench.workloads import QUESTION_SOURCES

ACCEPTANCE_BUDGET = 0.25
"""The budget the acceptance figures are read at."""

MIB = 2**20


# -- rows ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepSample:
    """Device memory after one step of a replay (a turn, or a question)."""

    step: str
    """`t1`, `t2`, … for turns, `q:<id>` for questions."""
    device_bytes: int
    host_bytes: int
    quantized_bytes: int
    attended_tokens: int
    logical_tokens: int


@dataclass(frozen=True)
class QuestionRow:
    """One question answered by one method at one budget."""

    workload: str
    method: str
    budget: float | None
    question: str
    source: str
    turn: int
    gold: str
    answer: str
    exact_match: bool
    logprob: float
    kl: float
    """KL(full ‖ method) at the answer position; 0 for `full` itself."""


@dataclass(frozen=True)
class RunRow:
    """One (workload, method, budget) run."""

    workload: str
    suite: str
    """`tuned` (the original four workloads) or `fresh`, see `agentkv_bench.methods.suite_of`."""
    method: str
    budget: float | None
    budget_tokens: int | None
    budget_bytes: int | None
    """`budget_tokens` in full-precision KV bytes (what `peak_device_bytes` is held to)."""
    full_tokens: int
    """Tokens the full cache attends at the final question (budgets are fractions of it)."""
    questions: int
    exact_match: float
    """Fraction of questions answered exactly."""
    mean_logprob: float
    mean_kl: float
    peak_device_bytes: int
    final_device_bytes: int
    host_bytes: int
    quantized_bytes: int
    peak_host_bytes: int
    peak_quantized_bytes: int
    peak_total_bytes: int
    """Largest device + quantized + host sampled after a step (at least `peak_device_bytes`)."""
    answer_device_bytes: float
    """Mean over questions of full-precision device KV bytes once the question is encoded."""
    answer_quantized_bytes: float
    answer_host_bytes: float
    answer_total_bytes: float
    """Mean over questions of device + quantized + host bytes once the question is encoded."""
    answer_attended_tokens: float
    """Mean over questions of the tokens the answer attends to."""
    lifecycle_seconds: float
    policy_seconds: float
    store_seconds: float
    forward_seconds: float
    overhead_seconds: float
    """lifecycle + policy + store (see `overhead_seconds`)."""
    overhead_pct: float
    """overhead_seconds / forward_seconds, in percent."""
    prefill_tokens: int
    restored_tokens: int
    rehydrated_tokens: int
    budget_unmet: int
    events_applied: int
    wall_seconds: float
    steps: list[StepSample] = field(default_factory=list)


def stats_fields(stats: SessionStats) -> dict[str, Any]:
    """The `SessionStats` fields a `RunRow` carries under the same names (one place, not a copy per field)."""
    names = {f.name for f in fields(SessionStats)}
    return {f.name: getattr(stats, f.name) for f in fields(RunRow) if f.name in names}


@dataclass(frozen=True)
class SummaryRow:
    """One (suite, method, budget) aggregated over the suite's workloads (`all`: every workload)."""

    suite: str
    method: str
    budget: float | None
    workloads: int
    questions: int
    exact_match_pct: float
    mean_logprob: float
    mean_kl: float
    budget_bytes: float | None
    """Mean over workloads of the device budget in bytes (None for `full`)."""
    peak_device_bytes: float
    """Mean over workloads of the peak full-precision device KV bytes (sampled after each budget check)."""
    peak_quantized_bytes: float
    peak_host_bytes: float
    peak_total_bytes: float
    """Mean over workloads of the peak device + quantized + host bytes (sampled after each step)."""
    answer_device_bytes: float
    """Mean over workloads of device (full precision + quantized) bytes at answer time."""
    answer_host_bytes: float
    answer_total_bytes: float
    answer_device_pct_of_full: float
    """`answer_device_bytes` over the full cache's at answer time, same workloads, in percent."""
    answer_total_pct_of_full: float
    """`answer_total_bytes` over the full cache's at answer time, same workloads, in percent."""
    rehydrated_tokens: int
    """Tokens recomputed from their ids (evicted spans rehydrated), summed over workloads."""
    restored_tokens: int
    """Tokens copied back from the host tier, summed over workloads."""
    budget_unmet: int
    """Budget checks that could not get under the high watermark, summed over workloads."""
    overhead_pct: float
    """Sum of overhead seconds over sum of forward seconds, in percent."""
    forward_seconds: float
    em_by_source: dict[str, float]


# -- aggregation ----------------------------------------------------------------------------------


def summarise(runs: Sequence[RunRow], questions: Sequence[QuestionRow]) -> list[SummaryRow]:
    """One row per (suite, method, budget), pooled over the suite's workloads.

    Suites: `all`, then `tuned` and `fresh` when the run holds both (with one suite,
    `all` is that suite and is the only one). Within a suite `full` comes first, then
    methods in `METHODS` order, larger budgets first.
    """
    present = [s for s in SUITES if any(r.suite == s for r in runs)]
    suites = ["all", *present] if len(present) > 1 else ["all"]
    order = list(METHODS)
    rows: list[SummaryRow] = []
    for suite in suites:
        mine_runs = [r for r in runs if suite == "all" or r.suite == suite]
        names = {r.workload for r in mine_runs}
        keys = list(dict.fromkeys((r.method, r.budget) for r in mine_runs))
        keys.sort(key=lambda k: (order.index(k[0]) if k[0] in order else len(order), -(k[1] or 2.0)))
        full = [r for r in mine_runs if r.method == "full"]
        full_device = _mean(float(r.answer_device_bytes + r.answer_quantized_bytes) for r in full)
        full_total = _mean(float(r.answer_total_bytes) for r in full)
        for method, budget in keys:
            mine = [r for r in mine_runs if r.method == method and r.budget == budget]
            qs = [q for q in questions if q.method == method and q.budget == budget and q.workload in names]
            rows.append(_summary_row(suite, method, budget, mine, qs, full_device, full_total))
    return rows


def _summary_row(
    suite: str,
    method: str,
    budget: float | None,
    mine: Sequence[RunRow],
    qs: Sequence[QuestionRow],
    full_device: float,
    full_total: float,
) -> SummaryRow:
    forward = sum(r.forward_seconds for r in mine)
    by_source: dict[str, float] = {}
    for source in sorted({q.source for q in qs}):
        picked = [q for q in qs if q.source == source]
        by_source[source] = 100.0 * sum(q.exact_match for q in picked) / len(picked)
    answer_device = _mean(float(r.answer_device_bytes + r.answer_quantized_bytes) for r in mine)
    answer_total = _mean(float(r.answer_total_bytes) for r in mine)
    return SummaryRow(
        suite=suite,
        method=method,
        budget=budget,
        workloads=len(mine),
        questions=len(qs),
        exact_match_pct=100.0 * sum(q.exact_match for q in qs) / max(1, len(qs)),
        mean_logprob=_mean(q.logprob for q in qs),
        mean_kl=_mean(q.kl for q in qs),
        budget_bytes=None if budget is None else _mean(float(r.budget_bytes or 0) for r in mine),
        peak_device_bytes=_mean(float(r.peak_device_bytes) for r in mine),
        peak_quantized_bytes=_mean(float(r.peak_quantized_bytes) for r in mine),
        peak_host_bytes=_mean(float(r.peak_host_bytes) for r in mine),
        peak_total_bytes=_mean(float(r.peak_total_bytes) for r in mine),
        answer_device_bytes=answer_device,
        answer_host_bytes=_mean(float(r.answer_host_bytes) for r in mine),
        answer_total_bytes=answer_total,
        answer_device_pct_of_full=_pct(answer_device, full_device),
        answer_total_pct_of_full=_pct(answer_total, full_total),
        rehydrated_tokens=sum(r.rehydrated_tokens for r in mine),
        restored_tokens=sum(r.restored_tokens for r in mine),
        budget_unmet=sum(r.budget_unmet for r in mine),
        overhead_pct=100.0 * sum(r.overhead_seconds for r in mine) / forward if forward > 0 else 0.0,
        forward_seconds=forward,
        em_by_source=by_source,
    )


def _pct(part: float, whole: float) -> float:
    return 100.0 * part / whole if whole > 0 and not math.isnan(whole) else float("nan")


def acceptance(
    summary: Sequence[SummaryRow], budget: float = ACCEPTANCE_BUDGET, *, suite: str = "all"
) -> dict[str, Any]:
    """The issue's acceptance figures at `budget`: agentkv vs full and vs the best baseline.

    Targets: exact match within 5 points of the full cache, at least 15 points above
    the best baseline, and lifecycle + policy + store overhead <= 5% of forward time.
    The memory each side held at answer time is reported with them (device and
    total, as a share of the full cache), so the comparison is read with what it cost.
    Empty when the run did not include that budget, `full` or `agentkv`.
    """
    by_key = {(s.method, s.budget): s for s in summary if s.suite == suite}
    full = by_key.get(("full", None))
    ours = by_key.get(("agentkv", budget))
    if full is None or ours is None:
        return {}
    baselines = [by_key[(b, budget)] for b in BASELINES if (b, budget) in by_key]
    best = max(baselines, key=lambda s: s.exact_match_pct, default=None)
    out: dict[str, Any] = {
        "suite": suite,
        "budget": budget,
        "full_em_pct": full.exact_match_pct,
        "agentkv_em_pct": ours.exact_match_pct,
        "agentkv_overhead_pct": ours.overhead_pct,
        "agentkv_answer_device_pct_of_full": ours.answer_device_pct_of_full,
        "agentkv_answer_total_pct_of_full": ours.answer_total_pct_of_full,
        "agentkv_rehydrated_tokens": ours.rehydrated_tokens,
        "within_5_points_of_full": ours.exact_match_pct >= full.exact_match_pct - 5.0,
        "overhead_at_most_5_pct": ours.overhead_pct <= 5.0,
    }
    if best is not None:
        out.update(
            best_baseline=best.method,
            best_baseline_em_pct=best.exact_match_pct,
            best_baseline_answer_total_pct_of_full=best.answer_total_pct_of_full,
            margin_over_best_baseline=ours.exact_match_pct - best.exact_match_pct,
            at_least_15_points_above_best_baseline=ours.exact_match_pct - best.exact_match_pct >= 15.0,
        )
    nohost = by_key.get(("agentkv-nohost", budget))
    if nohost is not None:
        out.update(
            nohost_em_pct=nohost.exact_match_pct,
            nohost_overhead_pct=nohost.overhead_pct,
            nohost_answer_total_pct_of_full=nohost.answer_total_pct_of_full,
            nohost_rehydrated_tokens=nohost.rehydrated_tokens,
        )
    return out


# -- presentation ---------------------------------------------------------------------------------

TABLE_COLUMNS: tuple[str, ...] = (
    "suite",
    "method",
    "budget",
    "EM %",
    "EM user/tool/conf/chosen",
    "mean KL",
    "budget MiB",
    "peak dev MiB",
    "peak host MiB",
    "peak total MiB",
    "answer dev MiB",
    "answer host MiB",
    "answer total MiB",
    "total % of full",
    "recomputed tok",
    "overhead %",
)
"""Columns of `memory_table`; device = full precision + quantized, total = device + host."""


def memory_table(result: dict[str, Any]) -> Any:
    """A rich table of the summary: one row per (suite, method, budget), pooled over workloads."""
    from rich.table import Table

    workloads = ", ".join(w["name"] for w in result["workloads"])
    table = Table(
        title=f"agentkv bench memory ({workloads}); budgets are fractions of the full cache; "
        "dev = device (fp + quantized), total = device + host; answer = once the question is encoded"
    )
    for name in TABLE_COLUMNS:
        table.add_column(name, justify="left" if name in ("suite", "method") else "right")
    for row in result["summary"]:
        table.add_row(*table_cells(row))
    return table


def table_cells(row: dict[str, Any]) -> list[str]:
    """One summary row (as in `memory.json`) as the strings of `TABLE_COLUMNS`."""
    budget = "—" if row["budget"] is None else f"{100 * row['budget']:g}%"
    src = row["em_by_source"]
    by_source = "/".join(f"{src[s]:.0f}" if s in src else "-" for s in QUESTION_SOURCES)
    peak_dev = row["peak_device_bytes"] + row["peak_quantized_bytes"]
    return [
        row["suite"],
        row["method"],
        budget,
        f"{row['exact_match_pct']:.1f}",
        by_source,
        f"{row['mean_kl']:.3f}",
        "—" if row["budget_bytes"] is None else f"{row['budget_bytes'] / MIB:.1f}",
        f"{peak_dev / MIB:.1f}",
        f"{row['peak_host_bytes'] / MIB:.1f}",
        f"{row['peak_total_bytes'] / MIB:.1f}",
        f"{row['answer_device_bytes'] / MIB:.1f}",
        f"{row['answer_host_bytes'] / MIB:.1f}",
        f"{row['answer_total_bytes'] / MIB:.1f}",
        f"{row['answer_total_pct_of_full']:.0f}",
        str(row["rehydrated_tokens"]),
        f"{row['overhead_pct']:.2f}",
    ]


def markdown_table(result: dict[str, Any]) -> str:
    """The summary as a Markdown table (what `docs/benchmarks.md` quotes)."""
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    lines += ["| " + " | ".join(table_cells(row)) + " |" for row in result["summary"]]
    return "\n".join(lines)


def acceptance_line(figures: dict[str, Any]) -> str:
    """One line with the acceptance figures (empty dict: a note that they were not measured)."""
    if not figures:
        return f"acceptance figures need full, agentkv and the {ACCEPTANCE_BUDGET:g} budget in one run"
    parts = [
        f"at {100 * figures['budget']:g}% ({figures.get('suite', 'all')} workloads): agentkv EM "
        f"{figures['agentkv_em_pct']:.1f}% vs full {figures['full_em_pct']:.1f}%, holding "
        f"{figures['agentkv_answer_device_pct_of_full']:.0f}% of the full cache on the device and "
        f"{figures['agentkv_answer_total_pct_of_full']:.0f}% in total (device + host)"
    ]
    if "best_baseline" in figures:
        parts.append(
            f"best baseline {figures['best_baseline']} {figures['best_baseline_em_pct']:.1f}% "
            f"(margin {figures['margin_over_best_baseline']:+.1f} points) holding "
            f"{figures['best_baseline_answer_total_pct_of_full']:.0f}% in total"
        )
    parts.append(f"overhead {figures['agentkv_overhead_pct']:.2f}% of forward time")
    return "; ".join(parts)


def plot_accuracy(summary: Sequence[SummaryRow], path: Path) -> None:
    """Exact match vs budget, one line per method; the full cache as a dashed reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = [s for s in summary if s.suite == "all"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    budgets = sorted({s.budget for s in summary if s.budget is not None})
    for method in METHODS:
        rows = sorted(
            (s for s in summary if s.method == method and s.budget is not None), key=lambda s: s.budget or 0
        )
        if rows:
            style = "o-" if method.startswith("agentkv") else "s--"
            ax.plot(
                [100 * (r.budget or 0) for r in rows], [r.exact_match_pct for r in rows], style, label=method
            )
    full = next((s for s in summary if s.method == "full"), None)
    if full is not None:
        ax.axhline(full.exact_match_pct, color="black", linestyle=":", label="full cache")
    ax.set_xscale("log", base=2)
    ax.set_xticks([100 * b for b in budgets])
    ax.set_xticklabels([f"{100 * b:g}%" for b in budgets])
    ax.set_xlabel("device KV budget (fraction of the full cache)")
    ax.set_ylabel("exact match (%)")
    ax.set_ylim(-2, 102)
    ax.legend(fontsize=8)
    ax.set_title("Recall of early facts vs device budget")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_device_bytes(runs: Sequence[RunRow], summary: Sequence[SummaryRow], path: Path) -> None:
    """Device KV bytes per step (turns, then questions): full vs agentkv vs the best baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = sorted({r.budget for r in runs if r.budget is not None})
    budget = min(budgets, key=lambda b: abs(b - ACCEPTANCE_BUDGET)) if budgets else None
    baselines = [s for s in summary if s.suite == "all" and s.method in BASELINES and s.budget == budget]
    baseline = max(baselines, key=lambda s: s.exact_match_pct).method if baselines else None
    workloads = list(dict.fromkeys(r.workload for r in runs))
    fig, axes = plt.subplots(
        1, max(1, len(workloads)), figsize=(4.2 * max(1, len(workloads)), 3.8), squeeze=False
    )
    for ax, workload in zip(axes[0], workloads, strict=False):
        for method, want in (("full", None), ("agentkv", budget), (baseline, budget)):
            run = next(
                (r for r in runs if r.workload == workload and r.method == method and r.budget == want), None
            )
            if run is None:
                continue
            label = method if want is None else f"{method} @{100 * want:g}%"
            steps = range(len(run.steps))
            device = [(s.device_bytes + s.quantized_bytes) / MIB for s in run.steps]
            (line,) = ax.plot(steps, device, ".-", label=f"{label} device")
            total = [(s.device_bytes + s.quantized_bytes + s.host_bytes) / MIB for s in run.steps]
            if total != device:
                ax.plot(steps, total, ":", color=line.get_color(), label=f"{label} device + host")
        ax.set_title(workload)
        ax.set_xlabel("turn, then questions")
        ax.set_ylabel("KV MiB")
        ax.legend(fontsize=7)
    fig.suptitle("KV bytes per step: device (solid) and device + host (dotted)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _mean(values: Iterable[float]) -> float:
    items = [v for v in values if not math.isnan(v)]
    return sum(items) / len(items) if items else float("nan")
