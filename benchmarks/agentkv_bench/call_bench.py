"""`agentkv bench calls`: is the next tool call under a device budget the full cache's call?

An agent's next tool call often copies a value from an earlier tool result (an id from a
search, a date from a schedule). This bench replays multi-turn tool-use traces
(`call_traces/*.json`: a system prompt, the tools, user turns, scripted calls with their
results, the agent's replies) into a session and, at every call step, asks the model for
the next call the way an agent does (`ChatAgentKV`, tools bound, grammar on), twice:
with `tool_choice="any"` and forced to the trace's own tool (only the arguments are the
model's). Then the trace's own call and result are appended, so every method sees the
same history at every step. Events are sent when the LangChain handler sends them
(`ToolCallCompleted` after the model call that read the result, `TurnEnded` after the reply).

Per (method, budget), against the full cache's call at the same step:

- the share of calls with the same tool, and with the same tool and arguments;
- forced to the trace's tool, the share with the full cache's arguments;
- the share equal to the trace's own call, and of the trace's argument values the forced
  call writes at the same place (what the full cache reaches is the ceiling);
- device, host and total bytes when the call is written, and whether the budget held.

The budget is a share of the tokens the full cache attends at the trace's last call
(its system prompt, tool block and whole history), as `agentkv bench memory` sizes it.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from rich.table import Table

from agentkv import TransformersBackend
from agentkv.events import Event, ToolCallCompleted, TurnEnded
from agentkv.progress import ProgressCallback, report
from agentkv_bench.methods import METHODS, Method
from agentkv_langchain.chat_models import ChatAgentKV

__all__ = [
    "CallRow",
    "CallTrace",
    "calls_summary",
    "calls_table",
    "load_call_traces",
    "parse_call_trace",
    "replay_calls",
    "run_calls_bench",
]

MAX_CALL_TOKENS = 128
"""Tokens a call may take (name and arguments); a call cut here counts as a different call."""


@dataclass(frozen=True)
class CallTrace:
    """One scripted tool-use conversation."""

    name: str
    system: str
    tools: tuple[Mapping[str, Any], ...]
    """`{"name", "description", "parameters"}` each (a JSON schema object)."""
    messages: tuple[Mapping[str, Any], ...]
    """`{"user": text}`, `{"call": {"name", "args"}, "result": text}` or `{"assistant": text}`, in order."""


@dataclass(frozen=True)
class CallRow:
    """One call step of one trace under one method and budget."""

    trace: str
    step: int
    """Index of the call among the trace's calls (0 = the first)."""
    method: str
    budget: float
    name: str | None
    """The tool the model called (None: no call parsed)."""
    args: dict[str, Any] | None
    """Its arguments (None: they did not parse)."""
    forced_args: dict[str, Any] | None
    """The arguments the model writes when the call is forced to the script's tool (None: unparsed)."""
    script_name: str
    script_args: dict[str, Any]
    attended_tokens: int
    """Tokens the call's first token attended (its prompt as the cache held it)."""
    device_bytes: int
    host_bytes: int
    budget_met: bool

    @property
    def script_values(self) -> float:
        """Share of the script's argument values the forced call writes at the same place (0..1)."""
        wanted = flat_args(self.script_args)
        written = flat_args(self.forced_args or {})
        return sum(written.get(k) == v for k, v in wanted.items()) / max(1, len(wanted))

    @property
    def call(self) -> str | None:
        """The call in one canonical text (None: nothing parsed), for comparing calls."""
        return None if self.name is None or self.args is None else canonical(self.name, self.args)


def canonical(name: str, args: Mapping[str, Any]) -> str:
    """`name` and `args` as one JSON text with sorted keys and integral floats as ints."""
    return json.dumps({"name": name, "args": plain(args)}, sort_keys=True)


def plain(value: Any) -> Any:
    """`value` with integral floats as ints, at any depth (`2.0` and `2` are the same argument)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def flat_args(args: Mapping[str, Any] | list[Any], path: str = "") -> dict[str, Any]:
    """Each leaf by its path, integral floats as ints: `{"a": {"b": [1, 2.0]}}` -> `{"a.b[0]": 1, ...}`."""
    out: dict[str, Any] = {}
    items = args.items() if isinstance(args, Mapping) else enumerate(args)
    for key, value in items:
        where = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)
        if isinstance(value, Mapping | list):
            out.update(flat_args(value, where))
        else:
            out[where] = plain(value)
    return out


# -- traces -------------------------------------------------------------------------------------


def trace_names() -> list[str]:
    """The shipped traces, by file name."""
    folder = resources.files("agentkv_bench").joinpath("call_traces")
    return sorted(p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json"))


def load_call_traces(names: Sequence[str] | None = None) -> list[CallTrace]:
    """The shipped traces named (all when None); a path to a JSON file works too."""
    folder = resources.files("agentkv_bench").joinpath("call_traces")
    out = []
    for name in names or trace_names():
        path = Path(name)
        if path.suffix == ".json" and path.exists():
            text = path.read_text(encoding="utf-8")
        else:
            source = folder.joinpath(f"{name}.json")
            if not source.is_file():
                msg = f"unknown call trace {name!r}; shipped: {', '.join(trace_names())}"
                raise ValueError(msg)
            text = source.read_text(encoding="utf-8")
        out.append(parse_call_trace(json.loads(text), where=name))
    return out


def parse_call_trace(data: Any, *, where: str = "trace") -> CallTrace:
    """Check a trace's shape (see `CallTrace`) and return it; a clear `ValueError` otherwise."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: a trace is a JSON object")
    missing = {"name", "system", "tools", "messages"} - set(data)
    if missing:
        raise ValueError(f"{where}: missing {sorted(missing)}")
    tools = {t.get("name"): t for t in data["tools"] if isinstance(t, Mapping)}
    if len(tools) != len(data["tools"]) or not tools or None in tools:
        raise ValueError(f"{where}: `tools` is a list of objects with distinct names")
    messages = list(data["messages"])
    if not messages or set(messages[0]) != {"user"}:
        raise ValueError(f"{where}: `messages` starts with a user message")
    for i, message in enumerate(messages):
        keys = set(message) if isinstance(message, Mapping) else set()
        if keys not in ({"user"}, {"assistant"}, {"call", "result"}):
            raise ValueError(f"{where}: message {i} is not {{user}}, {{assistant}} or {{call, result}}")
        call = message["call"] if "call" in keys else None
        if call is not None and not (isinstance(call, Mapping) and isinstance(call.get("args"), Mapping)):
            raise ValueError(f"{where}: message {i}'s call is not {{name, args}} with `args` an object")
        if call is not None and call.get("name") not in tools:
            raise ValueError(f"{where}: message {i} calls an unknown tool {call.get('name')!r}")
    if not any("call" in m for m in messages):
        raise ValueError(f"{where}: no call to ask the model for")
    return CallTrace(str(data["name"]), str(data["system"]), tuple(data["tools"]), tuple(messages))


def openai_tools(trace: CallTrace) -> list[dict[str, Any]]:
    """The trace's tools in the OpenAI form `bind_tools` takes."""
    keys = ("name", "description", "parameters")
    return [{"type": "function", "function": {k: t[k] for k in keys if k in t}} for t in trace.tools]


# -- one replay ---------------------------------------------------------------------------------


def replay_calls(
    backend: TransformersBackend, trace: CallTrace, *, method: str, budget: float, events: bool
) -> list[CallRow]:
    """Replay `trace` into a fresh session of `backend`, asking the model for every call.

    Events arrive when the LangChain handler sends them: a tool's `ToolCallCompleted`
    at the end of the model call that read its result (a result is encoded only by
    that call, so it is the current turn's active span while the next call is
    written), `TurnEnded` once the turn's reply is encoded.
    """
    session_id = f"calls:{trace.name}:{method}:{budget}"
    tools = openai_tools(trace)
    llm = ChatAgentKV(backend=backend, session_id=session_id, max_tokens=MAX_CALL_TOKENS)
    bound = llm.bind_tools(tools, tool_choice="any")
    session = backend.session(session_id)
    history: list[BaseMessage] = [SystemMessage(trace.system, id="system")]
    read: list[Event] = []  # outcomes of the tools whose results the next model call reads
    rows: list[CallRow] = []
    for i, message in enumerate(trace.messages):
        if "user" in message:
            history.append(HumanMessage(message["user"], id=f"u{i}"))
            continue
        if "assistant" in message:  # the turn's reply: a model call that reads the last results
            history.append(AIMessage(message["assistant"], id=f"a{i}"))
            session.extend(llm._plan(history, None, {"tools": tools}, session).messages)
            for event in [*read, TurnEnded()] if events else []:
                session.apply(event)
            read = []
            continue
        answer = bound.invoke(history)
        forced = llm.bind_tools(tools, tool_choice=message["call"]["name"]).invoke(history)
        rows.append(_row(trace, len(rows), method, budget, answer, forced, message["call"], session))
        for event in read:
            session.apply(event)
        call_id = f"call-{i}"
        call = {"name": message["call"]["name"], "args": dict(message["call"]["args"]), "id": call_id}
        history.append(AIMessage("", tool_calls=[call], id=f"c{i}"))
        history.append(ToolMessage(message["result"], tool_call_id=call_id))
        read = [ToolCallCompleted(tool_call_id=call_id)] if events else []
    backend.close(session_id)
    return rows


def _row(
    trace: CallTrace,
    step: int,
    method: str,
    budget: float,
    answer: AIMessage,
    forced: AIMessage,
    script: Mapping[str, Any],
    session: Any,
) -> CallRow:
    stats = session.stats()
    call = answer.tool_calls[0] if answer.tool_calls else None
    invalid = answer.invalid_tool_calls[0] if answer.invalid_tool_calls else None
    name = call["name"] if call else invalid["name"] if invalid else None
    attended = answer.usage_metadata["input_tokens"] if answer.usage_metadata else 0
    return CallRow(
        trace=trace.name,
        step=step,
        method=method,
        budget=budget,
        name=name,
        args=dict(call["args"]) if call else None,
        forced_args=dict(forced.tool_calls[0]["args"]) if forced.tool_calls else None,
        script_name=str(script["name"]),
        script_args=dict(script["args"]),
        attended_tokens=attended,
        device_bytes=stats.device_bytes,
        host_bytes=stats.host_bytes,
        budget_met=stats.budget_unmet == 0,
    )


# -- the bench ----------------------------------------------------------------------------------


def run_calls_bench(
    model: Any,
    tokenizer: Any,
    *,
    traces: Sequence[str] | None = None,
    methods: Sequence[str] = ("agentkv-nohost",),
    budgets: Sequence[float] = (0.25, 0.125),
    out_dir: Path | None = None,
    progress: ProgressCallback | None = None,
) -> dict[str, Any]:
    """Run the full cache, then every (method, budget), on every trace; write `calls.json`."""
    unknown = [m for m in methods if m not in METHODS or not METHODS[m].budgeted]
    if unknown:
        raise ValueError(f"unknown or unbudgeted methods {unknown}; budgeted: {_budgeted()}")
    loaded = load_call_traces(traces)
    total = len(loaded) * (1 + len(methods) * len(budgets))
    rows: list[CallRow] = []
    done = 0
    for trace in loaded:
        full = METHODS["full"]
        reference = replay_calls(
            _backend(model, tokenizer, full, None), trace, method="full", budget=1.0, events=False
        )
        rows += reference
        done += 1
        report(progress, "bench calls", done, total, f"{trace.name} full")
        full_tokens = max(r.attended_tokens for r in reference)
        for name in methods:
            method = METHODS[name]
            for budget in budgets:
                tokens = max(1, round(budget * full_tokens))
                backend = _backend(model, tokenizer, method, tokens)
                rows += replay_calls(backend, trace, method=name, budget=budget, events=method.events)
                done += 1
                report(progress, "bench calls", done, total, f"{trace.name} {name} {budget}")
    result = {
        "traces": [t.name for t in loaded],
        "rows": [asdict(r) for r in rows],
        "summary": calls_summary(rows),
    }
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "calls.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    return result


def _budgeted() -> list[str]:
    return [m for m, method in METHODS.items() if method.budgeted]


def _backend(model: Any, tokenizer: Any, method: Method, tokens: int | None) -> TransformersBackend:
    return TransformersBackend(model, tokenizer, method.config(tokens))


def calls_summary(rows: Sequence[CallRow]) -> list[dict[str, Any]]:
    """One line per (method, budget): agreement with the full cache's calls and with the script, and bytes."""
    full = {(r.trace, r.step): r for r in rows if r.method == "full"}
    groups: dict[tuple[str, float], list[CallRow]] = {}
    for row in rows:
        groups.setdefault((row.method, row.budget), []).append(row)
    out = []
    for (method, budget), group in groups.items():
        paired = [(r, full[(r.trace, r.step)]) for r in group if (r.trace, r.step) in full]
        scripted = [r.call == canonical(r.script_name, r.script_args) for r in group]
        out.append(
            {
                "method": method,
                "budget": budget,
                "calls": len(group),
                "same_tool_as_full": _share([r.name == f.name for r, f in paired]),
                "same_call_as_full": _share([r.call is not None and r.call == f.call for r, f in paired]),
                "script_tool": _share([r.name == r.script_name for r in group]),
                "script_call": _share(scripted),
                "forced_same_as_full": _share(
                    [
                        r.forced_args is not None and _same_args(r.forced_args, f.forced_args)
                        for r, f in paired
                    ]
                ),
                "script_values": statistics.fmean(r.script_values for r in group),
                "device_mib": statistics.fmean(r.device_bytes for r in group) / 2**20,
                "host_mib": statistics.fmean(r.host_bytes for r in group) / 2**20,
                "total_mib": statistics.fmean(r.device_bytes + r.host_bytes for r in group) / 2**20,
                "budget_met": all(r.budget_met for r in group),
            }
        )
    return out


def _same_args(a: Mapping[str, Any], b: Mapping[str, Any] | None) -> bool:
    return b is not None and plain(a) == plain(b)


def _share(flags: Sequence[bool]) -> float:
    return sum(flags) / max(1, len(flags))


def calls_table(result: Mapping[str, Any]) -> Table:
    """`bench calls`: one row per (method, budget)."""
    table = Table(
        title=f"agentkv bench calls: next tool call on {len(result['traces'])} traces (tool_choice=any)"
    )
    for column in (
        "method",
        "budget",
        "calls",
        "same tool as full",
        "same call as full",
        "script's tool",
        "script's call",
        "forced to the script's tool: same args as full",
        "script's values written",
        "at the call: device / host / total MiB",
        "budget held",
    ):
        table.add_column(column)
    for line in result["summary"]:
        table.add_row(
            line["method"],
            f"{line['budget']:g}",
            str(line["calls"]),
            f"{100 * line['same_tool_as_full']:.1f}%",
            f"{100 * line['same_call_as_full']:.1f}%",
            f"{100 * line['script_tool']:.1f}%",
            f"{100 * line['script_call']:.1f}%",
            f"{100 * line['forced_same_as_full']:.1f}%",
            f"{100 * line['script_values']:.1f}%",
            f"{line['device_mib']:.1f} / {line['host_mib']:.1f} / {line['total_mib']:.1f}",
            "yes" if line["budget_met"] else "no",
        )
    return table
