"""`agentkv bench memory`: recall fidelity vs device KV budget, agentkv against generic compressors.

Every method replays the same scripted agent conversations (see
`agentkv_bench.workloads`) into one session of the same model, then answers
recall questions about facts stated many turns earlier. The conversations are
scripted (user turns, tool results, branches *and* assistant answers), so every
method sees exactly the same history and only the final answers are generated.

Methods (`agentkv_bench.methods.METHODS`; `--methods` selects), all measured in one run:

- `full`: policy `full`, no budget: the reference every figure is compared with.
- `window`, `streaming_llm`, `h2o`, `snapkv`, `tova`: token-mode baselines as their
  papers define them. They get no lifecycle events (a generic compressor does not
  know them); under pressure they re-score every attended token and keep the top
  ones, up to the same high watermark agentkv's recall fills. SnapKV and TOVA score
  with their own observation window (SnapKV's last `window` queries, TOVA's last
  query), H2O with attention summed over every query, half its budget recent tokens.
- `agentkv`: the `lifecycle` policy with the host archive tier, fed the events an
  agent framework sends (tool call completed/failed, turn ended, user confirmed,
  branch opened/pruned/selected).
- `agentkv-nohost`: the same without a host tier (`NOHOST_TIER`): archived spans
  are dropped and recall recomputes them from their token ids.
- `agentkv-int4`: archived spans go to the int4 archive (on the device, not attended).
- `agentkv-host8`, `agentkv-archive-host8`: `agentkv` / `agentkv-archive` with the host
  archive held as int8 codes (`quantization.host_bits: 8`).
- `agentkv-q4`, `agentkv-q2`: `agentkv-nohost` with the attended cache held at
  int4 / int2, keys too (KIVI, `agentkv.store.attended`): the budget counts the bytes
  held, so about five (int4) to eight (int2) times more history stays attended.
- `agentkv-k8`: `agentkv-nohost` named with its default keys: 8 bits in two planes
  (`agentkv.store.key_planes`), kept up to the budget's limit; under more pressure keys
  drop to 4 bits before any span leaves attention.

Budgets are fractions of the `full` cache's size at the final question of each
workload (`budget.device_tokens`), the same for every budgeted method. A device
budget limits the device only: agentkv's host tier holds what it archives, so
every run reports device, host and total bytes (see `agentkv_bench.memory_report`),
and the tuned and fresh workloads are summarised separately.

Figures per (workload, method, budget): exact match of the greedy answer per
question (`exact_match`), the teacher-forced log-probability of the gold answer,
KL(full ‖ method) of the next-token distribution at the answer position, KV bytes
per tier (peak and at answer time), tokens restored from the host and recomputed
by rehydration, and time spent in lifecycle + policy + store against model
forward time.

Caveats a reader of the numbers needs: peaks are sampled after each operation's
budget check (a prefill or an answer may exceed the budget while it runs, for
every method alike); agentkv never demotes active or pinned spans, so a budget
smaller than the turn in progress is reported as exceeded, not enforced; the
attention probe that `lifecycle`, `h2o`, `snapkv` and `tova` use runs inside the
model's forward, so its cost is in `forward_seconds`, not in the overhead.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from agentkv.backend.session import Session
from agentkv.backend.transformers import TransformersBackend
from agentkv.events import (
    BranchOpened,
    BranchPruned,
    BranchSelected,
    ToolCallCompleted,
    ToolCallFailed,
    TurnEnded,
    UserConfirmed,
)
from agentkv.progress import ProgressCallback, report
from agentkv_bench.memory_report import (
    ACCEPTANCE_BUDGET,
    MIB,
    QuestionRow,
    RunRow,
    StepSample,
    SummaryRow,
    _mean,
    acceptance,
    acceptance_line,
    markdown_table,
    memory_table,
    plot_accuracy,
    plot_device_bytes,
    stats_fields,
    summarise,
)
from agentkv_bench.methods import BASELINES, METHODS, NOHOST_TIER, SUITES, Method, suite_of
from agentkv_bench.scoring import (
    answer_text,
    decided,
    exact_match,
    gold_logprob,
    kl_divergence,
    normalise_answer,
    overhead_seconds,
)
from agentkv_bench.workloads import Question, Workload, load_workloads

__all__ = [
    "ACCEPTANCE_BUDGET",
    "BASELINES",
    "DEFAULT_BUDGETS",
    "METHODS",
    "MIB",
    "NOHOST_TIER",
    "Method",
    "QuestionRow",
    "RunRow",
    "StepSample",
    "SummaryRow",
    "acceptance",
    "acceptance_line",
    "answer_text",
    "ask",
    "decided",
    "exact_match",
    "gold_logprob",
    "kl_divergence",
    "markdown_table",
    "memory_table",
    "normalise_answer",
    "replay",
    "run_memory_bench",
    "run_one",
    "summarise",
]

logger = logging.getLogger("agentkv_bench")

DEFAULT_BUDGETS: tuple[float, ...] = (0.5, 0.25, 0.125)
"""Device budgets as fractions of the full cache's size at the final question."""

ANSWER_EXTRA_TOKENS = 3
"""Greedy answers get the gold answer's token count plus this many tokens."""

QUICK_WORKLOADS: tuple[str, ...] = ("support",)
"""`quick=True` runs only these (the shortest shipped workload)."""


# -- replay -------------------------------------------------------------------------------------


def _tool_call_id(turn: int, index: int) -> str:
    return f"call-{turn}-{index}"


def replay(
    session: Session,
    workload: Workload,
    *,
    events: bool,
    on_step: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Feed a workload's turns into `session` the way an agent framework would; return the history.

    The model is "called" (the session extended) when a user message arrives, after
    each tool result and once the scripted answer is written, so the cache sees the
    same sequence of prefills a live agent produces. With `events`, the session also
    gets what the framework knows: `UserConfirmed` when a user message confirms the
    previous proposal, `ToolCallCompleted` / `ToolCallFailed` after a tool result,
    `BranchOpened` / `BranchPruned` / `BranchSelected` around tree-of-thought
    branches and `TurnEnded` after each answer.

    Branches run in branch sessions (`session.fork(branch)`, sharing the parent's
    KV prefix): each writes its reasoning there, and only the selected branch's
    conclusion (the turn's answer) enters the main conversation, as with LangGraph
    `Send` tasks. Branch sessions are closed when the segment ends, by the events
    for agentkv and by the framework's task cleanup for the others.
    """
    history: list[dict[str, Any]] = [{"role": "system", "content": workload.system, "id": "system"}]
    for t, turn in enumerate(workload.turns, start=1):
        history.append({"role": "user", "content": turn.user, "id": f"u{t}"})
        # A confirmation arrives with the user message that gives it, before that message's pressure.
        session.extend(history, events=_choice_events(workload, t) if events else [])
        for j, tool in enumerate(turn.tools):
            call_id = _tool_call_id(t, j)
            history.append(
                {
                    "role": "assistant",
                    "content": "",
                    "id": f"a{t}-call{j}",
                    "tool_calls": [{"id": call_id, "name": tool.name, "args": dict(tool.args)}],
                }
            )
            history.append({"role": "tool", "content": tool.result, "tool_call_id": call_id})
            session.extend(history)
            if events:
                done = ToolCallFailed(tool_call_id=call_id, error="tool error") if tool.failed else None
                session.apply(done or ToolCallCompleted(tool_call_id=call_id))
        if turn.branches is not None:
            _run_branches(session, history, turn.branches.options, turn.branches.selected, events=events)
        for proposal in turn.proposals:  # each option a message of its own, each one a finished answer
            message_id = _proposal_id(t, proposal.id)
            history.append({"role": "assistant", "content": proposal.text, "id": message_id})
            session.extend(history)
            if events:
                session.apply(TurnEnded())
        if turn.assistant:
            history.append({"role": "assistant", "content": turn.assistant, "id": f"a{t}"})
            session.extend(history)
            if events:
                session.apply(TurnEnded())
        if on_step is not None:
            on_step(f"t{t}")
    return history


def _proposal_id(turn: int, proposal: str) -> str:
    return f"a{turn}-{proposal}"


def _choice_events(workload: Workload, t: int) -> list[UserConfirmed]:
    """What the framework knows from turn `t`'s user message: the answer or the proposal it confirms.

    A chosen proposal is confirmed; the others get no event (a framework that knows
    only the user's pick says nothing of them), so they stay finished answers.
    """
    turn = workload.turns[t - 1]
    out: list[UserConfirmed] = []
    if turn.confirms_previous:
        out.append(UserConfirmed(owner=f"a{t - 1}"))
    if turn.chooses is not None:
        out.append(UserConfirmed(owner=_proposal_id(t - 1, turn.chooses)))
    return out


def _run_branches(
    session: Session, history: list[dict[str, Any]], options: Iterable[Any], selected: str, *, events: bool
) -> None:
    children: list[Session] = []
    for option in options:
        if events:
            session.apply(BranchOpened(branch=option.id))
        child = session.fork(option.id)
        child.extend(
            [*history, {"role": "assistant", "content": option.reasoning, "id": f"{option.id}-reasoning"}]
        )
        children.append(child)
    if events:
        for child in children:
            if child.branch != selected:
                session.apply(BranchPruned(branch=child.branch or ""))
        session.apply(BranchSelected(branch=selected))
    backend = session.backend
    for child in children:  # the branch task is over: whatever the events left open is closed now
        if child.session_id in backend and not child.closed:
            backend.close(child.session_id)


@dataclass(frozen=True)
class _Answer:
    answer: str
    exact_match: bool
    logprob: float
    first_logprobs: torch.Tensor
    attended_tokens: int
    """Tokens the cache attended right after the question was encoded (before answering)."""
    at_answer: StepSample
    """Bytes per tier once the question is encoded: the cache the answer is generated from."""


def greedy_answer(session: Session, prefix: str, gold: str, max_new_tokens: int) -> str:
    """Greedy continuation of `prefix` (the session's answer span), stopped once `decided`."""
    pieces: list[str] = []
    stream = session.stream(max_new_tokens, prefix=prefix, stop=["\n"])
    try:
        for piece in stream:
            pieces.append(piece)
            if decided("".join(pieces), gold):
                break
    finally:
        stream.close()  # type: ignore[attr-defined]
    return "".join(pieces)


def ask(session: Session, history: list[dict[str, Any]], question: Question) -> _Answer:
    """Ask one recall question after `history`; the previous question and its answer are cropped.

    Every question is asked of the same conversation (the session's prefix-matching
    `extend` drops the previous question and answer), so each is an independent
    probe; what earlier questions recalled may still be on the device, as in a live
    session.
    """
    session.extend([*history, {"role": "user", "content": question.question, "id": f"q-{question.id}"}])
    at_answer = sample_step(session, f"q:{question.id}")
    fmt = session.format
    prompt = fmt.generation_prompt_ids(session.messages) + fmt.encode(question.prefix)
    target = fmt.encode(answer_text(question.prefix, question.gold))
    logits = session.continuation_logits(prompt + target)
    logprob, first = gold_logprob(logits, len(prompt), target)
    answer = greedy_answer(session, question.prefix, question.gold, len(target) + ANSWER_EXTRA_TOKENS)
    return _Answer(
        answer, exact_match(answer, question.gold), logprob, first, at_answer.attended_tokens, at_answer
    )


# -- one run ------------------------------------------------------------------------------------


def sample_step(session: Session, step: str) -> StepSample:
    """The session's bytes per tier and attended tokens now, named `step`."""
    stats = session.stats()
    return StepSample(
        step,
        stats.device_bytes,
        stats.host_bytes,
        stats.quantized_bytes,
        stats.attended_tokens,
        stats.logical_tokens,
    )


@dataclass
class Peaks:
    """The largest host, quantized and total bytes over a run's samples, and the samples plotted."""

    host: int = 0
    quantized: int = 0
    total: int = 0
    """Largest device + quantized + host bytes at one sample."""
    samples: list[StepSample] = field(default_factory=list)

    def sample(self, session: Session, step: str) -> None:
        """Sample the session now (`sample_step`) and add it."""
        self.add(sample_step(session, step))

    def add(self, sample: StepSample, *, plot: bool = True) -> None:
        """Raise the peaks to `sample`'s figures; keep it among the plotted samples unless `plot` is False."""
        self.host = max(self.host, sample.host_bytes)
        self.quantized = max(self.quantized, sample.quantized_bytes)
        self.total = max(self.total, sample.device_bytes + sample.quantized_bytes + sample.host_bytes)
        if plot:
            self.samples.append(sample)


def run_one(
    backend: TransformersBackend,
    workload: Workload,
    method: Method,
    *,
    budget: float | None,
    budget_tokens: int | None,
    full_tokens: int,
    reference: dict[str, torch.Tensor] | None,
) -> tuple[RunRow, list[QuestionRow], dict[str, torch.Tensor], int]:
    """Replay one workload with one method and ask its questions.

    Returns:
        The run row, the question rows, the answer-position log-probs per question id
        (the `full` run's become the KL reference) and the attended tokens at the
        final question.
    """
    started = time.perf_counter()
    session_id = f"{workload.name}:{method.name}:{budget}"
    session = backend.session(session_id)
    peaks = Peaks()
    history = replay(
        session, workload, events=method.events, on_step=lambda step: peaks.sample(session, step)
    )
    rows: list[QuestionRow] = []
    first_logprobs: dict[str, torch.Tensor] = {}
    attended_at_last = 0
    at_answer: list[StepSample] = []
    for question in workload.questions:
        result = ask(session, history, question)
        attended_at_last = result.attended_tokens
        at_answer.append(result.at_answer)
        peaks.add(result.at_answer)  # the plotted step: the cache the answer is generated from
        peaks.add(sample_step(session, f"q:{question.id}:after"), plot=False)  # the answer's own KV
        first_logprobs[question.id] = result.first_logprobs
        kl = 0.0 if reference is None else kl_divergence(reference[question.id], result.first_logprobs)
        rows.append(
            QuestionRow(
                workload=workload.name,
                method=method.name,
                budget=budget,
                question=question.id,
                source=question.source,
                turn=question.turn,
                gold=question.gold,
                answer=result.answer,
                exact_match=result.exact_match,
                logprob=result.logprob,
                kl=kl,
            )
        )
    stats = session.stats()
    overhead = overhead_seconds(stats)
    run = RunRow(
        workload=workload.name,
        suite=suite_of(workload.name),
        method=method.name,
        budget=budget,
        budget_tokens=budget_tokens,
        budget_bytes=None if budget_tokens is None else budget_tokens * backend.runner.bytes_per_token,
        full_tokens=full_tokens or attended_at_last,
        questions=len(rows),
        exact_match=sum(r.exact_match for r in rows) / max(1, len(rows)),
        mean_logprob=_mean(r.logprob for r in rows),
        mean_kl=_mean(r.kl for r in rows),
        final_device_bytes=stats.device_bytes,
        peak_host_bytes=peaks.host,
        peak_quantized_bytes=peaks.quantized,
        peak_total_bytes=max(peaks.total, stats.peak_device_bytes),
        answer_device_bytes=_mean(float(a.device_bytes) for a in at_answer),
        answer_quantized_bytes=_mean(float(a.quantized_bytes) for a in at_answer),
        answer_host_bytes=_mean(float(a.host_bytes) for a in at_answer),
        answer_total_bytes=_mean(float(a.device_bytes + a.quantized_bytes + a.host_bytes) for a in at_answer),
        answer_attended_tokens=_mean(float(a.attended_tokens) for a in at_answer),
        overhead_seconds=overhead,
        overhead_pct=100.0 * overhead / stats.forward_seconds if stats.forward_seconds > 0 else 0.0,
        wall_seconds=time.perf_counter() - started,
        steps=peaks.samples,
        **stats_fields(stats),
    )
    backend.close(session_id)
    return run, rows, first_logprobs, attended_at_last


# -- the benchmark --------------------------------------------------------------------------------


def run_memory_bench(
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    budgets: Sequence[float] = DEFAULT_BUDGETS,
    methods: Sequence[str] | None = None,
    workloads: Sequence[str | Path] | None = None,
    out_dir: str | Path = "runs/memory",
    progress: ProgressCallback | None = None,
    show_table: bool = False,
    quick: bool = False,
) -> dict[str, Any]:
    """Run every (workload, method, budget), write `memory.json` and PNG plots under `out_dir`.

    Args:
        model: the causal LM, loaded once and shared by every method.
        tokenizer: its tokenizer.
        budgets: device budgets as fractions of the full cache's size at the final question.
        methods: names from `METHODS` (default: all). `full` always runs: it is the reference.
        workloads: shipped workload names or JSON paths (default: all shipped ones).
        out_dir: where `memory.json`, `memory_accuracy.png` and `memory_device.png` go.
        progress: called with a `ProgressStep` after each run (its `detail`: the run's figures).
        show_table: print the summary table with rich (the CLI prints it itself; off by default).
        quick: a smoke-sized run: `QUICK_WORKLOADS` and the 25% budget, unless `workloads`
            or `budgets` are given explicitly.

    Returns:
        The JSON document (`config`, `workloads`, `runs`, `questions`, `summary`, `acceptance`).
    """
    started = time.perf_counter()
    if quick:
        workloads = workloads if workloads is not None else QUICK_WORKLOADS
        budgets = budgets if budgets != DEFAULT_BUDGETS else (ACCEPTANCE_BUDGET,)
    names = list(methods) if methods is not None else list(METHODS)
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        msg = f"unknown method(s) {unknown}; allowed: {', '.join(METHODS)}"
        raise ValueError(msg)
    bad = [b for b in budgets if not 0 < b <= 1]
    if bad:
        msg = f"budgets must be fractions in (0, 1], got {bad}"
        raise ValueError(msg)
    chosen = [METHODS["full"], *(METHODS[n] for n in names if n != "full")]
    loaded = load_workloads(workloads)
    backends: dict[tuple[str, int | None], TransformersBackend] = {}

    def backend_for(method: Method, budget_tokens: int | None) -> TransformersBackend:
        key = (method.name, budget_tokens)
        if key not in backends:
            backends[key] = TransformersBackend(model, tokenizer, method.config(budget_tokens))
        return backends[key]

    runs: list[RunRow] = []
    questions: list[QuestionRow] = []
    workload_info: list[dict[str, Any]] = []
    total = len(loaded) * (1 + (len(chosen) - 1) * len(budgets))

    def measure(
        workload: Workload,
        method: Method,
        budget: float | None,
        full_tokens: int,
        reference: dict[str, torch.Tensor] | None,
    ) -> tuple[dict[str, torch.Tensor], int]:
        """Run one method at one budget (a fraction of `full_tokens`), keep its rows, report progress."""
        tokens = None if budget is None else max(1, round(budget * full_tokens))
        run, rows, logprobs, attended = run_one(
            backend_for(method, tokens),
            workload,
            method,
            budget=budget,
            budget_tokens=tokens,
            full_tokens=full_tokens,
            reference=reference,
        )
        runs.append(run)
        questions.extend(rows)
        _report(progress, len(runs), total, run)
        return logprobs, attended

    for workload in loaded:
        reference, full_tokens = measure(workload, METHODS["full"], None, 0, None)
        workload_info.append(
            {
                "name": workload.name,
                "suite": suite_of(workload.name),
                "title": workload.title,
                "turns": len(workload.turns),
                "questions": len(workload.questions),
                "full_tokens": full_tokens,
            }
        )
        for method in chosen[1:]:
            for budget in budgets:
                measure(workload, method, budget, full_tokens, reference)
    summary = summarise(runs, questions)
    result: dict[str, Any] = {
        "config": {
            "budgets": list(budgets),
            "methods": [m.name for m in chosen],
            "nohost_tier": NOHOST_TIER,
            "workloads": [w.name for w in loaded],
            "model": getattr(getattr(model, "config", None), "name_or_path", None) or type(model).__name__,
            "exact_match": "normalised greedy answer starts with the normalised gold answer, word-aligned "
            "(normalise: NFKC, casefold, alphanumeric words joined by one space); the answer is "
            f"generated after the completion prefix with gold tokens + {ANSWER_EXTRA_TOKENS} new tokens",
            "kl": "KL(full || method) in nats of the next-token distribution at the answer position "
            "(after the generation prompt and the completion prefix)",
            "overhead": "(lifecycle + policy + store seconds, exclusive) / forward_seconds",
            "torch_threads": torch.get_num_threads(),
        },
        "workloads": workload_info,
        "runs": [asdict(r) for r in runs],
        "questions": [asdict(q) for q in questions],
        "summary": [asdict(s) for s in summary],
        "acceptance": acceptance(summary),
        "acceptance_by_suite": {
            suite: acceptance(summary, suite=suite)
            for suite in SUITES
            if any(s.suite == suite for s in summary)
        },
        "wall_seconds": time.perf_counter() - started,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory.json").write_text(json.dumps(result, indent=2))
    lines = [markdown_table(result), "", acceptance_line(result["acceptance"])]
    lines += [acceptance_line(figures) for figures in result["acceptance_by_suite"].values()]
    (out / "memory.md").write_text("\n".join(lines) + "\n")
    plot_accuracy(summary, out / "memory_accuracy.png")
    plot_device_bytes(runs, summary, out / "memory_device.png")
    if show_table:
        from rich.console import Console

        console = Console()
        console.print(memory_table(result))
        console.print(acceptance_line(result["acceptance"]))
    return result


def _report(progress: ProgressCallback | None, done: int, total: int, run: RunRow) -> None:
    detail = (
        f"{run.workload} {run.method}"
        + ("" if run.budget is None else f" @{run.budget:g} ({run.budget_tokens} tok)")
        + f": EM {100 * run.exact_match:.0f}%, peak {run.peak_device_bytes / 2**20:.1f} MiB, "
        f"overhead {run.overhead_pct:.1f}%, {run.wall_seconds:.1f}s"
    )
    logger.info("[%d/%d] %s", done, total, detail)
    report(progress, "memory", done, total, detail)
