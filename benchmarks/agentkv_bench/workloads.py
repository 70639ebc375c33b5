"""Multi-turn agent workloads for `agentkv bench memory`, stored as JSON next to this module.

A workload is a scripted agent conversation: a system prompt, user turns that
state facts (names, codes, numbers, places), tool calls with long noisy results
(some with a fact buried in the noise, some failing), chit-chat, a
tree-of-thought segment whose branches get pruned, and scripted assistant
answers. Scripted answers make the benchmark deterministic and give every
method the identical history, so only the final questions are generated.

The questions at the end ask about facts stated many turns earlier. Each has a
gold answer and a completion-style prefix because the default model is tiny: it
copies a fact from its context far more reliably than it answers an open
question. At ~1,500-2,000 tokens of noisy context, SmolLM2-135M copies reliably
only when the prefix ends with the words that precede the fact in the
conversation, so prefixes quote them (`You told me: "Our grant number is` →
`NE/X01492/1`). The phrasings were checked against the *full-cache* run only
(it answers every shipped question), never against the methods under test. The
natural-language `question` is the user message; recall sees only that, never
the prefix (which is the start of the model's own answer).

JSON shape (one file per workload, `benchmarks/agentkv_bench/workloads/<name>.json`)::

    {"name": "travel", "title": "...", "system": "...",
     "turns": [{"user": "...", "confirms_previous": false,
                "tools": [{"name": "...", "args": {...}, "result": "...", "failed": false}],
                "branches": {"options": [{"id": "...", "reasoning": "..."}], "selected": "..."},
                "proposals": [{"id": "...", "text": "..."}], "chooses": "...",
                "assistant": "..."}],
     "questions": [{"id": "...", "question": "...", "prefix": "...", "gold": "...",
                    "source": "user|tool|confirmed|chosen", "turn": 1,
                    "style": "quote|paraphrase"}]}

Within a turn the order is: user message, tool calls (each a call and its
result), branches, proposals, assistant answer. `proposals` are options the
assistant writes as consecutive messages of their own, with no user message
between them (the shape agents produce when they list choices); `assistant` may
then be omitted. The next turn's `chooses` names the proposal its user message
picks (the framework sends `UserConfirmed` for it with that message, and
nothing for the others). `confirms_previous` means the user message
confirms the previous turn's assistant proposal (an agent framework sends
`UserConfirmed` for it). `turn` of a question is 1-based and names the turn whose
text holds the gold answer; loading checks that it really does, in the place
`source` names: the user message (`user`), a tool result (`tool`), the assistant
answer that the next user message confirms (`confirmed`), or the reasoning of the
selected tree-of-thought option or the proposal the next turn chooses (`chosen`;
the turn's answer may restate it, the other options hold other values of the
same kind).

`style` (optional, default `quote`) says how the question reaches the fact:
`quote` questions use the words of the source; `paraphrase` questions name the
fact in other words ("the Rust error code" for a log line `error[E0599]: ...`,
"the async runtime" for `tokio`) or refer back to it ("that flaky test from the
report earlier"), so a recall that matches the question's words to the span's
words misses them. Recall sees only the question; the prefix (the start of the
model's own answer) may still quote the source where the tiny model needs it to
copy. A report can split exact match by source and by style.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WORKLOAD_DIR = Path(__file__).with_name("workloads")
"""Where the shipped workload JSON files live."""

QUESTION_SOURCES: tuple[str, ...] = ("user", "tool", "confirmed", "chosen")
"""Where a question's fact was stated: a user message, a tool result, a confirmed proposal,
or the selected tree-of-thought option."""

QUESTION_STYLES: tuple[str, ...] = ("quote", "paraphrase")
"""How a question reaches its fact: quoting the words before it, or in other words."""

MIN_TURNS = 8
MAX_TURNS = 15


@dataclass(frozen=True)
class ToolStep:
    """One tool round trip inside a turn."""

    name: str
    args: Mapping[str, Any]
    result: str
    """The tool's output as the agent framework hands it to the model (long and noisy)."""
    failed: bool = False
    """True when the tool errored: the framework sends `ToolCallFailed` instead of `ToolCallCompleted`."""


@dataclass(frozen=True)
class BranchOption:
    """One tree-of-thought branch: its id and the reasoning written inside it."""

    id: str
    reasoning: str


@dataclass(frozen=True)
class Branches:
    """A tree-of-thought segment: several branches, one selected, the others pruned."""

    options: tuple[BranchOption, ...]
    selected: str


@dataclass(frozen=True)
class Proposal:
    """One option the assistant writes as a message of its own."""

    id: str
    text: str


@dataclass(frozen=True)
class Turn:
    """One user turn and everything the agent does before its answer."""

    user: str
    assistant: str
    """The closing answer; empty when the turn ends with its proposals."""
    tools: tuple[ToolStep, ...] = ()
    branches: Branches | None = None
    confirms_previous: bool = False
    proposals: tuple[Proposal, ...] = ()
    chooses: str | None = None
    """The id of the previous turn's proposal this user message picks."""

    def texts(self) -> list[str]:
        """Every text this turn puts in front of the model (for checking where facts are)."""
        out = [self.user, self.assistant, *(t.result for t in self.tools), *(p.text for p in self.proposals)]
        if self.branches is not None:
            out.extend(o.reasoning for o in self.branches.options)
        return out


@dataclass(frozen=True)
class Question:
    """A recall question asked after the conversation."""

    id: str
    question: str
    prefix: str
    """Start of the assistant's answer; the model continues it (completion-style)."""
    gold: str
    source: str
    """One of `QUESTION_SOURCES`."""
    turn: int
    """1-based turn whose text holds `gold`."""
    style: str = "quote"
    """One of `QUESTION_STYLES`."""


@dataclass(frozen=True)
class Workload:
    """A scripted multi-turn agent conversation with recall questions at the end."""

    name: str
    title: str
    system: str
    turns: tuple[Turn, ...]
    questions: tuple[Question, ...] = field(default_factory=tuple)


def workload_names(directory: str | Path | None = None) -> list[str]:
    """Names of the workloads in `directory` (default: the shipped ones), sorted."""
    folder = Path(directory) if directory is not None else WORKLOAD_DIR
    return sorted(p.stem for p in folder.glob("*.json"))


def load_workload(name_or_path: str | Path) -> Workload:
    """Load and validate one workload, by shipped name (`"travel"`) or by path to a JSON file.

    Raises:
        FileNotFoundError: No such workload; the message lists the shipped names.
        ValueError: The JSON is malformed or breaks the shape above; the message names
            the JSON path of the first problem (e.g. `travel.turns[3].tools[0].result`).
    """
    path = Path(name_or_path)
    if path.suffix != ".json":
        path = WORKLOAD_DIR / f"{name_or_path}.json"
    if not path.is_file():
        msg = f"workload {str(name_or_path)!r} not found; shipped workloads: {', '.join(workload_names())}"
        raise FileNotFoundError(msg)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        msg = f"{path}: invalid JSON: {e}"
        raise ValueError(msg) from e
    return parse_workload(data, where=path.stem)


def load_workloads(names: Sequence[str | Path] | None = None) -> list[Workload]:
    """Load several workloads (default: every shipped one, sorted by name)."""
    return [load_workload(name) for name in (names if names is not None else workload_names())]


def parse_workload(data: Any, *, where: str = "workload", min_turns: int = MIN_TURNS) -> Workload:
    """Validate a workload given as Python data (what the JSON file holds).

    Checks more than types: a question's gold answer must appear in the turn it
    names, so a typo in a workload cannot silently turn into a question no
    method can answer. `min_turns`: the fewest turns allowed (`agentkv bench forget`'s
    traces are shorter than the memory bench's workloads).
    """
    obj = _mapping(data, where)
    name = _text(obj, "name", where)
    where = name
    system = _text(obj, "system", where)
    title = _text(obj, "title", where) if "title" in obj else name
    raw_turns = _list(obj, "turns", where)
    if not min_turns <= len(raw_turns) <= MAX_TURNS:
        msg = f"{where}.turns: expected {min_turns} to {MAX_TURNS} turns, got {len(raw_turns)}"
        raise ValueError(msg)
    turns = tuple(_turn(t, f"{where}.turns[{i}]", first=i == 0) for i, t in enumerate(raw_turns))
    _check_choices(turns, f"{where}.turns")
    raw_questions = _list(obj, "questions", where)
    if not raw_questions:
        msg = f"{where}.questions: expected at least one question"
        raise ValueError(msg)
    questions = tuple(_question(q, f"{where}.questions[{i}]", turns) for i, q in enumerate(raw_questions))
    ids = [q.id for q in questions]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        msg = f"{where}.questions: duplicate ids {duplicates}"
        raise ValueError(msg)
    _check_keys(obj, {"name", "title", "system", "turns", "questions"}, where)
    return Workload(name=name, title=title, system=system, turns=turns, questions=questions)


# -- validation helpers ------------------------------------------------------------------------


def _turn(data: Any, where: str, *, first: bool) -> Turn:
    obj = _mapping(data, where)
    _check_keys(
        obj, {"user", "assistant", "tools", "branches", "confirms_previous", "proposals", "chooses"}, where
    )
    tools = tuple(_tool(t, f"{where}.tools[{j}]") for j, t in enumerate(obj.get("tools", []) or []))
    branches = _branches(obj["branches"], f"{where}.branches") if obj.get("branches") is not None else None
    proposals = _proposals(obj.get("proposals") or [], f"{where}.proposals")
    chooses = _text(obj, "chooses", where) if "chooses" in obj else None
    if chooses is not None and first:
        msg = f"{where}.chooses: the first turn has no previous proposals to choose from"
        raise ValueError(msg)
    confirms = obj.get("confirms_previous", False)
    if not isinstance(confirms, bool):
        msg = f"{where}.confirms_previous: expected true or false, got {confirms!r}"
        raise ValueError(msg)
    if confirms and first:
        msg = f"{where}.confirms_previous: the first turn has no previous answer to confirm"
        raise ValueError(msg)
    return Turn(
        user=_text(obj, "user", where),
        assistant=_text(obj, "assistant", where) if "assistant" in obj or not proposals else "",
        tools=tools,
        branches=branches,
        confirms_previous=confirms,
        proposals=proposals,
        chooses=chooses,
    )


def _proposals(raw: Any, where: str) -> tuple[Proposal, ...]:
    if not isinstance(raw, list):
        msg = f"{where}: expected a list, got {type(raw).__name__}"
        raise ValueError(msg)
    if len(raw) == 1:
        msg = f"{where}: a choice needs at least 2 proposals, got 1"
        raise ValueError(msg)
    return tuple(Proposal(id=i, text=text) for i, text in _options(raw, where, "text", "proposal"))


def _check_choices(turns: tuple[Turn, ...], where: str) -> None:
    """A turn's `chooses` names one of the previous turn's proposals."""
    for i, turn in enumerate(turns):
        if turn.chooses is None:
            continue
        ids = [p.id for p in turns[i - 1].proposals]
        if turn.chooses not in ids:
            msg = f"{where}[{i}].chooses: {turn.chooses!r} is not one of the previous turn's proposals {ids}"
            raise ValueError(msg)


def _tool(data: Any, where: str) -> ToolStep:
    obj = _mapping(data, where)
    _check_keys(obj, {"name", "args", "result", "failed"}, where)
    args = obj.get("args", {})
    if not isinstance(args, Mapping):
        msg = f"{where}.args: expected a mapping, got {type(args).__name__}"
        raise ValueError(msg)
    failed = obj.get("failed", False)
    if not isinstance(failed, bool):
        msg = f"{where}.failed: expected true or false, got {failed!r}"
        raise ValueError(msg)
    return ToolStep(
        name=_text(obj, "name", where), args=dict(args), result=_text(obj, "result", where), failed=failed
    )


def _branches(data: Any, where: str) -> Branches:
    obj = _mapping(data, where)
    _check_keys(obj, {"options", "selected"}, where)
    raw = _list(obj, "options", where)
    if len(raw) < 2:
        msg = f"{where}.options: a tree-of-thought segment needs at least 2 branches, got {len(raw)}"
        raise ValueError(msg)
    options = tuple(
        BranchOption(id=i, reasoning=text)
        for i, text in _options(raw, f"{where}.options", "reasoning", "branch")
    )
    ids = [o.id for o in options]
    selected = _text(obj, "selected", where)
    if selected not in ids:
        msg = f"{where}.selected: {selected!r} is not one of the branch ids {ids}"
        raise ValueError(msg)
    return Branches(options=options, selected=selected)


def _options(raw: list[Any], where: str, text_key: str, what: str) -> list[tuple[str, str]]:
    """`(id, text)` of each `{"id": ..., <text_key>: ...}` item; ids unique (`what` names them)."""
    items = []
    for k, item in enumerate(raw):
        at = f"{where}[{k}]"
        obj = _mapping(item, at)
        _check_keys(obj, {"id", text_key}, at)
        items.append((_text(obj, "id", at), _text(obj, text_key, at)))
    ids = [i for i, _ in items]
    if len(set(ids)) != len(ids):
        msg = f"{where}: {what} ids must be unique, got {ids}"
        raise ValueError(msg)
    return items


def _question(data: Any, where: str, turns: tuple[Turn, ...]) -> Question:
    obj = _mapping(data, where)
    _check_keys(obj, {"id", "question", "prefix", "gold", "source", "turn", "style"}, where)
    source = _text(obj, "source", where)
    if source not in QUESTION_SOURCES:
        msg = f"{where}.source: unknown {source!r}; allowed: {', '.join(QUESTION_SOURCES)}"
        raise ValueError(msg)
    style = _text(obj, "style", where) if "style" in obj else "quote"
    if style not in QUESTION_STYLES:
        msg = f"{where}.style: unknown {style!r}; allowed: {', '.join(QUESTION_STYLES)}"
        raise ValueError(msg)
    turn = obj.get("turn")
    if isinstance(turn, bool) or not isinstance(turn, int) or not 1 <= turn <= len(turns):
        msg = f"{where}.turn: expected a turn number from 1 to {len(turns)}, got {turn!r}"
        raise ValueError(msg)
    question = Question(
        id=_text(obj, "id", where),
        question=_text(obj, "question", where),
        prefix=_text(obj, "prefix", where),
        gold=_text(obj, "gold", where),
        source=source,
        turn=turn,
        style=style,
    )
    stated = turns[turn - 1]
    if not any(question.gold in text for text in stated.texts()):
        msg = f"{where}.gold: {question.gold!r} does not appear in turn {turn}"
        raise ValueError(msg)
    places = _source_texts(source, stated, turns[turn] if turn < len(turns) else None)
    if not any(question.gold in text for text in places):
        msg = f"{where}.source: {question.gold!r} is in turn {turn} but not in its {_SOURCE_PLACE[source]}"
        raise ValueError(msg)
    return question


_SOURCE_PLACE = {
    "user": "user message",
    "tool": "tool results",
    "confirmed": "assistant answer confirmed by the next turn (confirms_previous)",
    "chosen": "selected tree-of-thought option or chosen proposal",
}


def _source_texts(source: str, turn: Turn, following: Turn | None) -> list[str]:
    """The texts of `turn` where a fact of `source` must be stated."""
    if source == "user":
        return [turn.user]
    if source == "tool":
        return [t.result for t in turn.tools]
    if source == "confirmed":
        return [turn.assistant] if following is not None and following.confirms_previous else []
    # chosen
    out: list[str] = []
    if turn.branches is not None:
        out.extend(o.reasoning for o in turn.branches.options if o.id == turn.branches.selected)
    if following is not None and following.chooses is not None:
        out.extend(p.text for p in turn.proposals if p.id == following.chooses)
    return out


def _mapping(data: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        msg = f"{where}: expected a mapping, got {type(data).__name__}"
        raise ValueError(msg)
    return data


def _text(obj: Mapping[str, Any], key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value.strip():
        msg = f"{where}.{key}: expected a non-empty string, got {value!r}"
        raise ValueError(msg)
    return value


def _list(obj: Mapping[str, Any], key: str, where: str) -> list[Any]:
    value = obj.get(key)
    if not isinstance(value, list):
        msg = f"{where}.{key}: expected a list, got {type(value).__name__}"
        raise ValueError(msg)
    return value


def _check_keys(obj: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        msg = f"{where}: unknown key(s) {unknown}; allowed: {', '.join(sorted(allowed))}"
        raise ValueError(msg)
