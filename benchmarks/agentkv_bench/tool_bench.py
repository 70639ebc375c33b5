"""`agentkv bench tools`: do tool calls and structured output parse, with and without the grammar?

On a tool set written for this bench (`tool_bench.json`: 21 tools with nested objects,
enums, arrays, optional and required keys, integers and numbers; three prompts each),
on the loaded model, in one run:

- forced calls (`tool_choice=<tool>`): the share that parse and validate against the
  tool's schema, grammar on and off;
- `tool_choice="any"` with all 21 tools bound: the share that call the tool the prompt
  is about, grammar on (the name chosen under the call grammar) and off (names scored);
- structured output: one schema as a pydantic class, a TypedDict and a JSON schema,
  `function_calling` and `json_schema`: the share that parse and validate;
- a `create_agent` loop with two tools (`tool_use="call_then_answer"`), 10 turns on one
  thread: turns with a parsed call to the right tool and a text answer;
- decode time per token with the call grammar against unconstrained decoding on the same
  prompts (same session, same prefill), and the grammar's compile time per tool and per
  tool set.

Validation uses `validate` (the JSON-schema keywords this set uses), not the grammar.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any, TypedDict

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from pydantic import BaseModel
from rich.table import Table

from agentkv import TransformersBackend
from agentkv.grammar import GrammarProcessor, compile_grammar, text_or_call_grammar, tool_call_grammar
from agentkv.progress import ProgressCallback, report
from agentkv_langchain.chat_models import ChatAgentKV
from agentkv_langchain.tools import call_opening

__all__ = ["load_tool_set", "run_tools_bench", "tools_table", "validate"]

SYSTEM = "You are a helpful assistant. Use the tools to answer."
MAX_NEW_TOKENS = 64
OVERHEAD_PROMPTS = 12
OVERHEAD_TOKENS = 32


def load_tool_set() -> list[dict[str, Any]]:
    """The bench's tools: `{"name", "description", "parameters", "prompts"}` each."""
    text = resources.files("agentkv_bench").joinpath("tool_bench.json").read_text(encoding="utf-8")
    return list(json.loads(text)["tools"])


def openai_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    """The OpenAI form of a bench tool."""
    function = {k: tool[k] for k in ("name", "description", "parameters")}
    return {"type": "function", "function": function}


def validate(value: Any, schema: Mapping[str, Any], path: str = "$") -> str | None:
    """The first way `value` breaks `schema`, or None.

    Checks the keywords the bench's schemas use: type, enum, properties, required,
    extra keys, items, minItems / maxItems, minimum / maximum.
    """
    kind = schema.get("type")
    checks = {
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "array": lambda v: isinstance(v, list),
        "object": lambda v: isinstance(v, dict),
    }
    if kind in checks and not checks[kind](value):
        return f"{path}: expected {kind}, got {type(value).__name__}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{path}: {value!r} not in {schema['enum']}"
    if kind in ("integer", "number") and not schema.get("minimum", value) <= value <= schema.get(
        "maximum", value
    ):
        return f"{path}: {value} outside [{schema.get('minimum')}, {schema.get('maximum')}]"
    if kind == "array":
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            return f"{path}: {len(value)} items"
        for i, item in enumerate(value):
            if (error := validate(item, schema.get("items", {}), f"{path}[{i}]")) is not None:
                return error
    if kind == "object":
        properties = schema.get("properties", {})
        missing = [k for k in schema.get("required", []) if k not in value]
        extra = [k for k in value if k not in properties]
        if missing or (extra and not schema.get("additionalProperties", False)):
            return f"{path}: missing {missing}, extra {extra}"
        for key, item in value.items():
            if key in properties and (error := validate(item, properties[key], f"{path}.{key}")) is not None:
                return error
    return None


def _call_outcome(message: AIMessage, tool: Mapping[str, Any]) -> dict[str, Any]:
    calls = message.tool_calls
    parsed = bool(calls) and not message.invalid_tool_calls
    error = validate(calls[0]["args"], tool["parameters"]) if parsed else "no parsed call"
    return {
        "name": calls[0]["name"] if calls else None,
        "parsed": parsed,
        "valid": parsed and error is None and calls[0]["name"] == tool["name"],
        "error": error,
        "output_tokens": message.usage_metadata["output_tokens"] if message.usage_metadata else 0,
    }


def _rate(rows: list[dict[str, Any]], key: str) -> float:
    return sum(bool(r[key]) for r in rows) / max(1, len(rows))


def forced_calls(
    backend: TransformersBackend, tools: list[dict[str, Any]], grammar: bool
) -> list[dict[str, Any]]:
    """Every prompt with a forced call to its own tool (one session per tool: the tool prompt is reused)."""
    rows = []
    for tool in tools:
        llm = ChatAgentKV(
            backend=backend,
            grammar=grammar,
            max_tokens=MAX_NEW_TOKENS,
            session_id=f"forced-{grammar}-{tool['name']}",
        )
        bound = llm.bind_tools([openai_tool(tool)], tool_choice=tool["name"])
        for prompt in tool["prompts"]:
            message = bound.invoke([SystemMessage(SYSTEM), HumanMessage(prompt)])
            rows.append({"tool": tool["name"], "prompt": prompt, **_call_outcome(message, tool)})
    return rows


def any_calls(
    backend: TransformersBackend, tools: list[dict[str, Any]], grammar: bool
) -> list[dict[str, Any]]:
    """Every prompt with all tools bound and `tool_choice="any"`: did the model call the prompt's tool?"""
    llm = ChatAgentKV(
        backend=backend, grammar=grammar, max_tokens=MAX_NEW_TOKENS, session_id=f"any-{grammar}"
    )
    bound = llm.bind_tools([openai_tool(t) for t in tools], tool_choice="any")
    rows = []
    for tool in tools:
        for prompt in tool["prompts"]:
            message = bound.invoke([SystemMessage(SYSTEM), HumanMessage(prompt)])
            outcome = _call_outcome(message, tool)
            rows.append(
                {"tool": tool["name"], "prompt": prompt, **outcome, "right": outcome["name"] == tool["name"]}
            )
    return rows


class Reservation(BaseModel):
    """A restaurant reservation."""

    restaurant: str
    party_size: int
    time: str


class ReservationDict(TypedDict):
    """A restaurant reservation."""

    restaurant: str
    party_size: int
    time: str


RESERVATION_SCHEMA = {
    "title": "Reservation",
    "description": "A restaurant reservation.",
    "type": "object",
    "properties": {
        "restaurant": {"type": "string"},
        "party_size": {"type": "integer"},
        "time": {"type": "string"},
    },
    "required": ["restaurant", "party_size", "time"],
}
STRUCTURED_PROMPTS = (
    "Book a table for 4 at Luigi's at 7pm.",
    "Two people at Sakura tomorrow at 8.",
    "Table for 6 at The Anchor, 12:30.",
    "A reservation at Chez Paul for three at noon.",
    "We are 5, dinner at Rosa's at 19:45.",
)


def structured_outputs(backend: TransformersBackend, grammar: bool) -> list[dict[str, Any]]:
    """The reservation schema in three forms, two methods, five prompts: parsed and valid?"""
    forms: dict[str, Any] = {
        "pydantic": Reservation,
        "typeddict": ReservationDict,
        "json_schema": RESERVATION_SCHEMA,
    }
    rows = []
    for form, schema in forms.items():
        for method in ("function_calling", "json_schema"):
            llm = ChatAgentKV(
                backend=backend,
                grammar=grammar,
                max_tokens=MAX_NEW_TOKENS,
                session_id=f"so-{grammar}-{form}-{method}",
            )
            runnable = llm.with_structured_output(schema, method=method, include_raw=True)
            for prompt in STRUCTURED_PROMPTS:
                out = runnable.invoke([HumanMessage(f"Extract the reservation: {prompt}")])
                parsed = out["parsed"]
                value = parsed.model_dump() if isinstance(parsed, BaseModel) else parsed
                error = str(out["parsing_error"])[:120] if out["parsing_error"] else None
                if error is None:
                    error = validate(value, RESERVATION_SCHEMA) if value is not None else "nothing parsed"
                rows.append(
                    {"form": form, "method": method, "prompt": prompt, "valid": error is None, "error": error}
                )
    return rows


AGENT_TURNS = (
    "What is the weather in Paris?",
    "What is 12 plus 30?",
    "How is the weather in Tokyo?",
    "Add 7 and 5.",
    "Tell me the weather in Cairo.",
    "What is 100 plus 250?",
    "Is it sunny in Oslo?",
    "Add 3 and 4.",
    "What is the weather like in Lima?",
    "Compute 40 plus 2.",
)


def agent_loop(backend: TransformersBackend, grammar: bool) -> list[dict[str, Any]]:
    """A `create_agent` loop with two tools, 10 turns on one thread."""
    from langchain.agents import create_agent
    from langgraph.checkpoint.memory import InMemorySaver

    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return f"It is sunny and 21 degrees in {city}."

    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    llm = ChatAgentKV(backend=backend, grammar=grammar, max_tokens=48, tool_use="call_then_answer")
    agent = create_agent(llm, [get_weather, add], checkpointer=InMemorySaver())
    config: Any = {"configurable": {"thread_id": f"agent-{grammar}"}, "recursion_limit": 12}
    rows = []
    for i, question in enumerate(AGENT_TURNS):
        seen = len(agent.get_state(config).values.get("messages", [])) if i else 0
        out = agent.invoke({"messages": [HumanMessage(question)]}, config)
        new = out["messages"][seen:]
        calls = [c for m in new if isinstance(m, AIMessage) for c in m.tool_calls]
        invalid = [c for m in new if isinstance(m, AIMessage) for c in m.invalid_tool_calls]
        want = "get_weather" if "weather" in question or "sunny" in question else "add"
        final = new[-1]
        answered = isinstance(final, AIMessage) and not final.tool_calls and bool(final.text.strip())
        rows.append(
            {
                "turn": i + 1,
                "question": question,
                "calls": [c["name"] for c in calls],
                "invalid": len(invalid),
                "results": sum(isinstance(m, ToolMessage) for m in new),
                "parsed": bool(calls) and not invalid,
                "right_tool": [c["name"] for c in calls][:1] == [want],
                "answered": answered,
                "complete": bool(calls) and not invalid and answered,
            }
        )
    return rows


def decode_overhead(backend: TransformersBackend, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """Seconds per decoded token with the call grammar vs unconstrained, same prompt and prefix.

    Each prompt runs unconstrained then constrained on the same session (the prompt is
    cached by then), `OVERHEAD_TOKENS` at most; per-token figures are summed over prompts.
    """
    fmt = backend.chat_format
    stops = fmt.stop_token_ids()
    totals = {"free_s": 0.0, "free_tokens": 0, "grammar_s": 0.0, "grammar_tokens": 0, "mask_s": 0.0}
    llm = ChatAgentKV(backend=backend, max_tokens=OVERHEAD_TOKENS)
    for n, tool in enumerate(t for t in tools for _ in t["prompts"][:1]):
        if n >= OVERHEAD_PROMPTS:
            break
        schema = openai_tool(tool)
        session = backend.session(f"overhead-{tool['name']}")
        messages = llm._plan(
            [SystemMessage(SYSTEM), HumanMessage(tool["prompts"][0])], None, {"tools": [schema]}
        ).messages
        session.extend(messages)
        prefix = call_opening(tool["name"])
        for mode in ("free", "grammar", "free", "grammar"):  # the first pair warms up
            processor = None
            if mode == "grammar":
                compiled = compile_grammar(backend.tokenizer, stops, tool_call_grammar([schema]))
                processor = _Timed(GrammarProcessor(compiled, fmt.encode(prefix)))
            before = session.stats().generated_tokens
            started = time.perf_counter()
            session.generate(max_new_tokens=OVERHEAD_TOKENS, prefix=prefix, logits_processor=processor)
            seconds = time.perf_counter() - started
            tokens = session.stats().generated_tokens - before
            session.extend(messages)  # crop the answer: the next run starts from the same prompt
            if processor is not None:
                totals["mask_s"] += processor.seconds
            totals[f"{mode}_s"] += seconds
            totals[f"{mode}_tokens"] += tokens
        backend.close(session.session_id)
    free = totals["free_s"] / max(1, totals["free_tokens"])
    constrained = totals["grammar_s"] / max(1, totals["grammar_tokens"])
    return {
        "prompts": min(OVERHEAD_PROMPTS, len(tools)),
        "free_ms_per_token": 1000 * free,
        "grammar_ms_per_token": 1000 * constrained,
        "overhead_pct": 100 * (constrained / free - 1),
        "mask_ms_per_token": 1000 * totals["mask_s"] / max(1, totals["grammar_tokens"]),
        **totals,
    }


class _Timed:
    """A logits processor wrapper that adds up the time spent in it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seconds = 0.0

    def __call__(self, produced: Any, logits: Any) -> Any:
        started = time.perf_counter()
        out = self.inner(produced, logits)
        self.seconds += time.perf_counter() - started
        return out


def compile_times(backend: TransformersBackend, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """Compile time (first time, not cached) per tool's call grammar, and for all tools together."""
    stops = backend.chat_format.stop_token_ids()
    schemas = [openai_tool(t) for t in tools]
    # The tokenizer view is built once per tokenizer (not per grammar): build it before timing.
    compile_grammar(backend.tokenizer, stops, 'start: "x"\n')
    per_tool = [
        compile_grammar(backend.tokenizer, stops, tool_call_grammar([s]) + "// bench\n").compile_seconds
        for s in schemas
    ]
    union = compile_grammar(
        backend.tokenizer, stops, tool_call_grammar(schemas) + "// bench\n"
    ).compile_seconds
    auto = compile_grammar(
        backend.tokenizer, stops, text_or_call_grammar(schemas) + "// bench\n"
    ).compile_seconds
    return {
        "per_tool_ms_median": 1000 * statistics.median(per_tool),
        "per_tool_ms_max": 1000 * max(per_tool),
        "all_tools_any_ms": 1000 * union,
        "all_tools_auto_ms": 1000 * auto,
    }


def run_tools_bench(
    model: Any, tokenizer: Any, *, out_dir: Path | None = None, progress: ProgressCallback | None = None
) -> dict[str, Any]:
    """Run every part (see the module docstring); write `tools.json` under `out_dir`."""
    backend = TransformersBackend(model, tokenizer)
    tools = load_tool_set()
    parts: list[tuple[str, Any]] = [
        ("compile", lambda: compile_times(backend, tools)),
        ("forced_grammar", lambda: forced_calls(backend, tools, True)),
        ("forced_free", lambda: forced_calls(backend, tools, False)),
        ("any_grammar", lambda: any_calls(backend, tools, True)),
        ("any_free", lambda: any_calls(backend, tools, False)),
        ("structured_grammar", lambda: structured_outputs(backend, True)),
        ("structured_free", lambda: structured_outputs(backend, False)),
        ("agent_grammar", lambda: agent_loop(backend, True)),
        ("agent_free", lambda: agent_loop(backend, False)),
        ("overhead", lambda: decode_overhead(backend, tools)),
    ]
    result: dict[str, Any] = {"tools": len(tools), "prompts": sum(len(t["prompts"]) for t in tools)}
    for i, (name, part) in enumerate(parts):
        report(progress, "bench tools", i, len(parts), name)
        started = time.perf_counter()
        result[name] = part()
        result.setdefault("seconds", {})[name] = round(time.perf_counter() - started, 1)
    report(progress, "bench tools", len(parts), len(parts), "done")
    result["summary"] = summary(result)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "tools.json").write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")
    return result


def summary(result: Mapping[str, Any]) -> dict[str, Any]:
    """The headline rates, grammar on and off."""
    out: dict[str, Any] = {}
    for mode in ("grammar", "free"):
        out[mode] = {
            "forced_parsed": _rate(result[f"forced_{mode}"], "parsed"),
            "forced_valid": _rate(result[f"forced_{mode}"], "valid"),
            "any_parsed": _rate(result[f"any_{mode}"], "parsed"),
            "any_right_tool": _rate(result[f"any_{mode}"], "right"),
            "structured_valid": _rate(result[f"structured_{mode}"], "valid"),
            "agent_complete_turns": sum(r["complete"] for r in result[f"agent_{mode}"]),
            "agent_right_tool_turns": sum(r["right_tool"] for r in result[f"agent_{mode}"]),
        }
    return out


def tools_table(result: Mapping[str, Any]) -> Table:
    """The summary as a table: one row per figure, grammar on and off."""
    table = Table(title=f"agentkv bench tools: {result['tools']} tools, {result['prompts']} prompts")
    for name in ("figure", "grammar", "no grammar"):
        table.add_column(name, justify="right" if name != "figure" else "left")
    on, off = result["summary"]["grammar"], result["summary"]["free"]
    labels = {
        "forced_parsed": "forced call parses",
        "forced_valid": "forced call validates",
        "any_parsed": '"any" call parses',
        "any_right_tool": '"any" picks the right tool',
        "structured_valid": "structured output validates",
    }
    for key, label in labels.items():
        table.add_row(label, f"{100 * on[key]:.1f}%", f"{100 * off[key]:.1f}%")
    for key, label in (
        ("agent_complete_turns", "agent turns complete /10"),
        ("agent_right_tool_turns", "agent right tool /10"),
    ):
        table.add_row(label, str(on[key]), str(off[key]))
    overhead, compiled = result["overhead"], result["compile"]
    table.add_row(
        "decode ms/token", f"{overhead['grammar_ms_per_token']:.1f}", f"{overhead['free_ms_per_token']:.1f}"
    )
    table.add_row(
        "per-token overhead",
        f"{overhead['overhead_pct']:+.1f}% (mask {overhead['mask_ms_per_token']:.2f} ms)",
        "",
    )
    table.add_row(
        "compile ms: tool (median / max), 21-tool any, auto",
        f"{compiled['per_tool_ms_median']:.1f} / {compiled['per_tool_ms_max']:.1f}, "
        f"{compiled['all_tools_any_ms']:.1f}, {compiled['all_tools_auto_ms']:.1f}",
        "",
    )
    return table
