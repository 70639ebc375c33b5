"""`agentkv bench memory`: recall fidelity vs device KV budget, agentkv against generic compressors.

Every method replays the same scripted agent conversations (see
`agentkv.bench.workloads`) into one session of the same model, then answers
recall questions about facts stated many turns earlier. The conversations are
scripted (user turns, tool results, branches *and* assistant answers), so every
method sees exactly the same history and only the final answers are generated.

Methods, all measured in one run:

- `full`: policy `full`, no budget: the reference every figure is compared with.
- `window`, `streaming_llm`, `h2o`, `snapkv`: token-mode baselines. They get no
  lifecycle events (a generic compressor does not know them); under pressure they
  re-score every attended token and keep the top ones.
- `agentkv`: the `lifecycle` policy with the host archive tier, fed the events an
  agent framework sends (tool call completed/failed, turn ended, user confirmed,
  branch opened/pruned/selected).
- `agentkv-nohost`: the same without a host tier (`NOHOST_TIER`): archived spans
  are dropped and recall recomputes them from their token ids.

Budgets are fractions of the `full` cache's size at the final question of each
workload (`budget.device_tokens`), the same for every budgeted method.

Figures per (workload, method, budget): exact match of the greedy answer per
question (`exact_match`), the teacher-forced log-probability of the gold answer,
KL(full ‖ method) of the next-token distribution at the answer position, device
KV bytes (peak and final), host and quantized bytes, and time spent in lifecycle
+ policy + store against model forward time.

Caveats a reader of the numbers needs: peaks are sampled after each operation's
budget check (a prefill or an answer may exceed the budget while it runs, for
every method alike); agentkv never demotes active or pinned spans, so a budget
smaller than the turn in progress is reported as exceeded, not enforced; the
attention probe that `lifecycle`, `h2o` and `snapkv` use runs inside the model's
forward, so its cost is in `forward_seconds`, not in the overhead.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from agentkv.backend.session import Session
from agentkv.backend.transformers import TransformersBackend
from agentkv.bench.workloads import Question, Workload, load_workloads
from agentkv.config import AgentKVConfig
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

logger = logging.getLogger("agentkv.bench")

DEFAULT_BUDGETS: tuple[float, ...] = (0.5, 0.25, 0.125)
"""Device budgets as fractions of the full cache's size at the final question."""

NOHOST_TIER = "drop"
"""Archive tier of `agentkv-nohost`: archived spans are dropped and recomputed on recall."""

ANSWER_EXTRA_TOKENS = 3
"""Greedy answers get the gold answer's token count plus this many tokens."""

ACCEPTANCE_BUDGET = 0.25
"""The budget the acceptance figures are read at."""

QUICK_WORKLOADS: tuple[str, ...] = ("support",)
"""`quick=True` runs only these (the shortest shipped workload)."""


# -- methods ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    """One way to run a session under a budget."""

    name: str
    policy: str
    """`AgentKVConfig.policy` name."""
    archive_tier: str = "host"
    budgeted: bool = True
    """False for `full`: it runs once per workload, with no budget."""
    events: bool = False
    """True when the session gets the lifecycle events an agent framework sends."""

    def config(self, budget_tokens: int | None) -> AgentKVConfig:
        """The session config of this method at a device budget in tokens (None = unlimited)."""
        data: dict[str, Any] = {"policy": self.policy, "archive_tier": self.archive_tier}
        if self.budgeted and budget_tokens is not None:
            data["budget"] = {"device_tokens": int(budget_tokens)}
        return AgentKVConfig.from_dict(data)


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("full", "full", budgeted=False),
        Method("window", "window"),
        Method("streaming_llm", "streaming_llm"),
        Method("h2o", "h2o"),
        Method("snapkv", "snapkv"),
        Method("agentkv", "lifecycle", archive_tier="host", events=True),
        Method("agentkv-nohost", "lifecycle", archive_tier=NOHOST_TIER, events=True),
    )
}
"""Every method the benchmark knows, in report order."""

BASELINES: tuple[str, ...] = ("window", "streaming_llm", "h2o", "snapkv")
"""Generic compressors (token mode, no events)."""


# -- metrics ------------------------------------------------------------------------------------

_WORD = re.compile(r"[^\W_]+")


def normalise_answer(text: str) -> str:
    """Casefolded alphanumeric words joined by single spaces (NFKC first).

    Punctuation and spacing differences ("KX7-4471." vs "kx7 4471") are not what
    the benchmark measures; which characters and digits the model copied is.
    """
    return " ".join(_WORD.findall(unicodedata.normalize("NFKC", text).casefold()))


def exact_match(answer: str, gold: str) -> bool:
    """Whether the greedy continuation *starts with* the gold answer, word-aligned, after normalising.

    The answer is the text generated after the completion prefix ("The booking code
    is"), so a correct answer begins with the fact: `" KX7-4471."` matches gold
    `"KX7-4471"`, `" KX7-4471 and"` matches too, `" KX7-44712"` (a different
    number) and `" the code KX7-4471"` (not where the fact belongs) do not.
    """
    a, g = normalise_answer(answer), normalise_answer(gold)
    if not g:
        return False
    return a == g or a.startswith(g + " ")


def kl_divergence(reference_logprobs: torch.Tensor, logprobs: torch.Tensor) -> float:
    """KL(reference ‖ other) in nats, from two `[V]` log-probability vectors."""
    p = reference_logprobs.double()
    q = logprobs.double()
    return float((p.exp() * (p - q)).sum().clamp_min(0.0))


def gold_logprob(logits: torch.Tensor, prompt_len: int, target: Sequence[int]) -> tuple[float, torch.Tensor]:
    """Teacher-forced log-prob of `target` and the log-distribution of its first token.

    Args:
        logits: `[prompt_len + len(target), V]` rows of `Session.continuation_logits(prompt + target)`;
            row i is the distribution after token i.
        prompt_len: tokens of the generation prompt plus the completion prefix (>= 1).
        target: token ids of the gold answer.

    Returns:
        (sum of log-probs of the target tokens, `[V]` log-probs at the answer position).
    """
    if prompt_len < 1:
        msg = f"prompt_len must be >= 1 (the answer position follows the prompt), got {prompt_len}"
        raise ValueError(msg)
    rows = torch.log_softmax(logits[prompt_len - 1 : prompt_len - 1 + len(target)].float(), dim=-1)  # [T, V]
    picked = rows[torch.arange(len(target)), torch.tensor(list(target), dtype=torch.long)]
    return float(picked.sum()), rows[0]


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


@dataclass(frozen=True)
class SummaryRow:
    """One (method, budget) aggregated over workloads."""

    method: str
    budget: float | None
    questions: int
    exact_match_pct: float
    mean_logprob: float
    mean_kl: float
    budget_bytes: float | None
    """Mean over workloads of the device budget in bytes (None for `full`)."""
    peak_device_bytes: float
    """Mean over workloads of the session's peak device KV bytes (sampled after each budget check)."""
    final_device_bytes: float
    host_bytes: float
    quantized_bytes: float
    overhead_pct: float
    """Sum of overhead seconds over sum of forward seconds, in percent."""
    forward_seconds: float
    em_by_source: dict[str, float]


def overhead_seconds(stats: Any) -> float:
    """Time in lifecycle + policy + store, from `SessionStats`.

    `LifecycleManager._timed` sections nest (a budget check inside
    `lifecycle_seconds` moves spans inside `store_seconds`, which may score them
    inside `policy_seconds`); the manager charges each section only its own time
    (nested sections and model forwards excluded), so the three add up without
    double counting.
    """
    return float(stats.lifecycle_seconds + stats.policy_seconds + stats.store_seconds)


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
        session.extend(history)
        if events and turn.confirms_previous:
            session.apply(UserConfirmed(owner=f"a{t - 1}"))
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
        history.append({"role": "assistant", "content": turn.assistant, "id": f"a{t}"})
        session.extend(history)
        if events:
            session.apply(TurnEnded())
        if on_step is not None:
            on_step(f"t{t}")
    return history


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


def answer_text(prefix: str, gold: str) -> str:
    """How the gold answer continues `prefix`: after a space, unless the prefix ends in one.

    Prefixes that end inside a token (an opening quote, `C-`, `Binomial(`) are continued
    directly, so the teacher-forced target is tokenised the way the model writes it.
    """
    return gold if not prefix or prefix[-1] in _GLUED else " " + gold


_GLUED = frozenset(" \t\n\"'([{-/")


def decided(answer: str, gold: str) -> bool:
    """Whether more greedy tokens can no longer change `exact_match(answer, gold)`.

    Decoding stops there: a correct answer needs the gold's words plus one more
    word or the end, a wrong one is wrong from its first diverging character.
    """
    a, g = normalise_answer(answer), normalise_answer(gold)
    if a.startswith(g + " "):
        return True
    return not (g.startswith(a) or a.startswith(g))


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
    attended = session.stats().attended_tokens
    fmt = session.format
    prompt = fmt.generation_prompt_ids(session.messages) + fmt.encode(question.prefix)
    target = fmt.encode(answer_text(question.prefix, question.gold))
    logits = session.continuation_logits(prompt + target)
    logprob, first = gold_logprob(logits, len(prompt), target)
    answer = greedy_answer(session, question.prefix, question.gold, len(target) + ANSWER_EXTRA_TOKENS)
    return _Answer(answer, exact_match(answer, question.gold), logprob, first, attended)


# -- one run ------------------------------------------------------------------------------------


@dataclass
class _Peaks:
    host: int = 0
    quantized: int = 0
    samples: list[StepSample] = field(default_factory=list)

    def sample(self, session: Session, step: str) -> None:
        stats = session.stats()
        self.host = max(self.host, stats.host_bytes)
        self.quantized = max(self.quantized, stats.quantized_bytes)
        self.samples.append(
            StepSample(
                step,
                stats.device_bytes,
                stats.host_bytes,
                stats.quantized_bytes,
                stats.attended_tokens,
                stats.logical_tokens,
            )
        )


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
    peaks = _Peaks()
    history = replay(
        session, workload, events=method.events, on_step=lambda step: peaks.sample(session, step)
    )
    rows: list[QuestionRow] = []
    first_logprobs: dict[str, torch.Tensor] = {}
    attended_at_last = 0
    for question in workload.questions:
        result = ask(session, history, question)
        attended_at_last = result.attended_tokens
        peaks.sample(session, f"q:{question.id}")
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
        method=method.name,
        budget=budget,
        budget_tokens=budget_tokens,
        budget_bytes=None if budget_tokens is None else budget_tokens * backend.runner.bytes_per_token,
        full_tokens=full_tokens or attended_at_last,
        questions=len(rows),
        exact_match=sum(r.exact_match for r in rows) / max(1, len(rows)),
        mean_logprob=_mean(r.logprob for r in rows),
        mean_kl=_mean(r.kl for r in rows),
        peak_device_bytes=stats.peak_device_bytes,
        final_device_bytes=stats.device_bytes,
        host_bytes=stats.host_bytes,
        quantized_bytes=stats.quantized_bytes,
        peak_host_bytes=peaks.host,
        peak_quantized_bytes=peaks.quantized,
        lifecycle_seconds=stats.lifecycle_seconds,
        policy_seconds=stats.policy_seconds,
        store_seconds=stats.store_seconds,
        forward_seconds=stats.forward_seconds,
        overhead_seconds=overhead,
        overhead_pct=100.0 * overhead / stats.forward_seconds if stats.forward_seconds > 0 else 0.0,
        prefill_tokens=stats.prefill_tokens,
        restored_tokens=stats.restored_tokens,
        rehydrated_tokens=stats.rehydrated_tokens,
        budget_unmet=stats.budget_unmet,
        events_applied=stats.events_applied,
        wall_seconds=time.perf_counter() - started,
        steps=peaks.samples,
    )
    backend.close(session_id)
    return run, rows, first_logprobs, attended_at_last


def _mean(values: Iterable[float]) -> float:
    items = [v for v in values if not math.isnan(v)]
    return sum(items) / len(items) if items else float("nan")


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
    done = 0
    for workload in loaded:
        full = METHODS["full"]
        run, rows, reference, full_tokens = run_one(
            backend_for(full, None),
            workload,
            full,
            budget=None,
            budget_tokens=None,
            full_tokens=0,
            reference=None,
        )
        runs.append(run)
        questions.extend(rows)
        done += 1
        _report(progress, done, total, run)
        workload_info.append(
            {
                "name": workload.name,
                "title": workload.title,
                "turns": len(workload.turns),
                "questions": len(workload.questions),
                "full_tokens": full_tokens,
            }
        )
        for method in chosen[1:]:
            for budget in budgets:
                tokens = max(1, round(budget * full_tokens))
                run, rows, _, _ = run_one(
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
                done += 1
                _report(progress, done, total, run)
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
        "wall_seconds": time.perf_counter() - started,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory.json").write_text(json.dumps(result, indent=2))
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


# -- aggregation ----------------------------------------------------------------------------------


def summarise(runs: Sequence[RunRow], questions: Sequence[QuestionRow]) -> list[SummaryRow]:
    """One row per (method, budget), pooled over workloads; `full` first, then methods in `METHODS` order."""
    keys: list[tuple[str, float | None]] = []
    for run in runs:
        if (run.method, run.budget) not in keys:
            keys.append((run.method, run.budget))
    order = list(METHODS)
    keys.sort(key=lambda k: (order.index(k[0]) if k[0] in order else len(order), -(k[1] or 2.0)))
    rows: list[SummaryRow] = []
    for method, budget in keys:
        mine = [r for r in runs if r.method == method and r.budget == budget]
        qs = [q for q in questions if q.method == method and q.budget == budget]
        forward = sum(r.forward_seconds for r in mine)
        by_source: dict[str, float] = {}
        for source in sorted({q.source for q in qs}):
            picked = [q for q in qs if q.source == source]
            by_source[source] = 100.0 * sum(q.exact_match for q in picked) / len(picked)
        rows.append(
            SummaryRow(
                method=method,
                budget=budget,
                questions=len(qs),
                exact_match_pct=100.0 * sum(q.exact_match for q in qs) / max(1, len(qs)),
                mean_logprob=_mean(q.logprob for q in qs),
                mean_kl=_mean(q.kl for q in qs),
                budget_bytes=None if budget is None else _mean(float(r.budget_bytes or 0) for r in mine),
                peak_device_bytes=_mean(float(r.peak_device_bytes) for r in mine),
                final_device_bytes=_mean(float(r.final_device_bytes) for r in mine),
                host_bytes=_mean(float(r.peak_host_bytes) for r in mine),
                quantized_bytes=_mean(float(r.peak_quantized_bytes) for r in mine),
                overhead_pct=100.0 * sum(r.overhead_seconds for r in mine) / forward if forward > 0 else 0.0,
                forward_seconds=forward,
                em_by_source=by_source,
            )
        )
    return rows


def acceptance(summary: Sequence[SummaryRow], budget: float = ACCEPTANCE_BUDGET) -> dict[str, Any]:
    """The issue's acceptance figures at `budget`: agentkv vs full and vs the best baseline.

    Targets: exact match within 5 points of the full cache, at least 15 points above
    the best baseline, and lifecycle + policy + store overhead <= 5% of forward time.
    Empty when the run did not include that budget, `full` or `agentkv`.
    """
    by_key = {(s.method, s.budget): s for s in summary}
    full = by_key.get(("full", None))
    ours = by_key.get(("agentkv", budget))
    if full is None or ours is None:
        return {}
    baselines = [by_key[(b, budget)] for b in BASELINES if (b, budget) in by_key]
    best = max(baselines, key=lambda s: s.exact_match_pct, default=None)
    out: dict[str, Any] = {
        "budget": budget,
        "full_em_pct": full.exact_match_pct,
        "agentkv_em_pct": ours.exact_match_pct,
        "agentkv_overhead_pct": ours.overhead_pct,
        "within_5_points_of_full": ours.exact_match_pct >= full.exact_match_pct - 5.0,
        "overhead_at_most_5_pct": ours.overhead_pct <= 5.0,
    }
    if best is not None:
        out.update(
            best_baseline=best.method,
            best_baseline_em_pct=best.exact_match_pct,
            margin_over_best_baseline=ours.exact_match_pct - best.exact_match_pct,
            at_least_15_points_above_best_baseline=ours.exact_match_pct - best.exact_match_pct >= 15.0,
        )
    nohost = by_key.get(("agentkv-nohost", budget))
    if nohost is not None:
        out.update(nohost_em_pct=nohost.exact_match_pct, nohost_overhead_pct=nohost.overhead_pct)
    return out


# -- presentation ---------------------------------------------------------------------------------


def memory_table(result: dict[str, Any]) -> Any:
    """A rich table of the summary: one row per (method, budget), pooled over workloads."""
    from rich.table import Table

    workloads = ", ".join(w["name"] for w in result["workloads"])
    table = Table(title=f"agentkv bench memory ({workloads}; budgets are fractions of the full cache)")
    for name in (
        "method",
        "budget",
        "EM %",
        "EM user/tool/conf",
        "mean logprob",
        "mean KL",
        "budget MiB",
        "peak device MiB",
        "host MiB",
        "overhead %",
    ):
        table.add_column(name, justify="left" if name == "method" else "right")
    for row in result["summary"]:
        budget = "—" if row["budget"] is None else f"{100 * row['budget']:g}%"
        src = row["em_by_source"]
        by_source = "/".join(f"{src[s]:.0f}" if s in src else "-" for s in ("user", "tool", "confirmed"))
        table.add_row(
            row["method"],
            budget,
            f"{row['exact_match_pct']:.1f}",
            by_source,
            f"{row['mean_logprob']:.2f}",
            f"{row['mean_kl']:.3f}",
            "—" if row["budget_bytes"] is None else f"{row['budget_bytes'] / 2**20:.1f}",
            f"{row['peak_device_bytes'] / 2**20:.1f}",
            f"{row['host_bytes'] / 2**20:.1f}",
            f"{row['overhead_pct']:.2f}",
        )
    return table


def acceptance_line(figures: dict[str, Any]) -> str:
    """One line with the acceptance figures (empty dict: a note that they were not measured)."""
    if not figures:
        return f"acceptance figures need full, agentkv and the {ACCEPTANCE_BUDGET:g} budget in one run"
    parts = [
        f"at {100 * figures['budget']:g}%: agentkv EM {figures['agentkv_em_pct']:.1f}% vs full "
        f"{figures['full_em_pct']:.1f}%"
    ]
    if "best_baseline" in figures:
        parts.append(
            f"best baseline {figures['best_baseline']} {figures['best_baseline_em_pct']:.1f}% "
            f"(margin {figures['margin_over_best_baseline']:+.1f} points)"
        )
    parts.append(f"overhead {figures['agentkv_overhead_pct']:.2f}% of forward time")
    return "; ".join(parts)


def plot_accuracy(summary: Sequence[SummaryRow], path: Path) -> None:
    """Exact match vs budget, one line per method; the full cache as a dashed reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    baselines = [s for s in summary if s.method in BASELINES and s.budget == budget]
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
            ax.plot(range(len(run.steps)), [s.device_bytes / 2**20 for s in run.steps], ".-", label=label)
            if method == "agentkv":
                ax.plot(
                    range(len(run.steps)),
                    [s.host_bytes / 2**20 for s in run.steps],
                    ":",
                    label="agentkv host tier",
                )
        ax.set_title(workload)
        ax.set_xlabel("turn, then questions")
        ax.set_ylabel("KV MiB")
        ax.legend(fontsize=7)
    fig.suptitle("Device KV bytes per step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
