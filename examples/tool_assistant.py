"""A LangGraph tool-calling assistant whose KV cache follows the agent's lifecycle.

Ten-plus scripted user turns; on the turns that need a tool the model is forced to
call it (`tool_choice=<tool>`, decoded under the tool's grammar, so even the 135M
default model's call parses and follows its schema), the tool returns a long
result, and the model answers from it. agentkv turns the agent's moments into
cache events:

- `ToolCallCompleted`: the tool result is COMMITTED (kept), the call that asked
  for it is released (EVICTABLE: the first thing to go under pressure);
- `ToolCallFailed` (the `lookup` of an unknown record raises): the error output is
  committed (the agent must not retry blindly), the call that failed is released;
- `TurnEnded` (the graph run ends): the user message and the answer are committed.

Every model call sends the whole history, and `ChatAgentKV` encodes only what the
cache does not hold yet. Run `python examples/tool_assistant.py` to see the per-turn
prefill against re-encoding the whole history each call (what a stateless chat model
does), and the device KV bytes at the end with a lifecycle budget on and off.
The agent (tools, script, graph) is `agentkv_langgraph.demo_agent`, shared with
`agentkv demo`, which runs it with and without agentkv side by side.
"""

from __future__ import annotations

import time
from typing import Any

from langchain_core.messages import AIMessage, AnyMessage
from langchain_core.runnables import RunnableConfig

from agentkv import TransformersBackend
from agentkv_langchain import ChatAgentKV
from agentkv_langgraph import shared_backend, with_kv_lifecycle

# The agent itself (tools, script, graph) ships in the package, so `agentkv demo` runs it too.
from agentkv_langgraph.demo_agent import SCRIPT, TOOLS, State, Turn, build_graph, turn_input

__all__ = ["SCRIPT", "TOOLS", "State", "Turn", "build_graph", "main", "replay"]


def main(
    backend: TransformersBackend | None = None,
    turns: int = len(SCRIPT),
    *,
    device_tokens: int | None = None,
    max_new_tokens: int = 32,
    thread_id: str = "tool-assistant",
    measure: bool = False,
) -> dict[str, Any]:
    """Run the scripted conversation; return what happened.

    Args:
        backend: The model's backend; None = the default model (loaded once per process).
        turns: How many scripted turns (the script repeats past its end).
        device_tokens: A per-session device KV budget in tokens (None = no budget).
        max_new_tokens: Length limit of each answer.
        thread_id: The LangGraph thread (one agentkv session).
        measure: Also replay every model call's history with re-encoding, for the comparison.

    Returns:
        `events` (what the handler sent), `spans` (the session's span map after the run),
        `calls` (per model call: prefill and reused tokens), `stats` (the session's: its
        `device_bytes` are this conversation's KV), `backend_device_bytes` (all sessions),
        `repaired` (forced calls whose arguments had to be filled in), and with
        `measure`, `reuse` (per model call: prefill tokens and seconds, incremental vs re-encoded).
    """
    backend = backend or shared_backend()
    llm = ChatAgentKV(backend=backend, max_new_tokens=max_new_tokens)
    config = backend.config
    if device_tokens is not None:
        config = config.with_overrides({"budget": {"device_tokens": device_tokens}})
    graph = with_kv_lifecycle(build_graph(llm), backend=backend, config=config)
    run_config: RunnableConfig = {"configurable": {"thread_id": thread_id}}
    calls: list[dict[str, Any]] = []
    for i in range(turns):
        before = len(graph.get_state(run_config).values.get("messages", []))
        out = graph.invoke(turn_input(i), run_config)
        messages: list[AnyMessage] = out["messages"]
        for message in messages[before:]:
            if isinstance(message, AIMessage):
                meta = message.response_metadata
                calls.append(
                    {
                        "turn": i,
                        "prefill_tokens": meta.get("prefill_tokens", 0),
                        "reused_tokens": meta.get("reused_tokens", 0),
                        "tool_calls": [c["name"] for c in message.tool_calls],
                    }
                )
    session = backend.get(thread_id)
    snapshot = session.snapshot()
    result: dict[str, Any] = {
        "events": [(sid, type(e).__name__, _target(e)) for sid, e in graph.agentkv.handler.events],
        "spans": [
            {k: s[k] for k in ("span_id", "kind", "owner", "state", "tier", "tokens", "turn")}
            for s in snapshot["spans"]
        ],
        "calls": calls,
        "stats": snapshot["stats"],
        "backend_device_bytes": backend.device_bytes(),
        "repaired": out.get("repaired", 0),
        "handler_errors": graph.agentkv.handler.errors,
        "messages": [(type(m).__name__, str(m.content)[:80]) for m in out["messages"]],
    }
    if measure:
        result["reuse"] = replay(backend, thread_id)
    return result


def replay(backend: TransformersBackend, session_id: str) -> list[dict[str, Any]]:
    """Per model call: prefill tokens and seconds (≈ time to first token), incremental vs re-encoded.

    The history each model call saw is a prefix of the session's messages (the system
    prompt with the tool prompt, the turns so far). Both replays feed exactly those
    prefixes; the only difference is whether the cache is kept between calls.
    """
    messages = list(backend.get(session_id).messages)
    cuts = [k for k, m in enumerate(messages) if m.role == "assistant"]
    rows: list[dict[str, Any]] = []
    kept = backend.session(f"{session_id}-replay-incremental")
    for i, cut in enumerate(cuts):
        history = messages[:cut]
        started = time.perf_counter()
        incremental = kept.extend(history)
        kept_seconds = time.perf_counter() - started
        fresh = backend.session(f"{session_id}-replay-fresh")
        started = time.perf_counter()
        full = fresh.extend(history)
        fresh_seconds = time.perf_counter() - started
        backend.close(fresh.session_id)
        rows.append(
            {
                "call": i,
                "history_tokens": full.prefilled_tokens,
                "incremental_prefill": incremental.prefilled_tokens,
                "incremental_seconds": round(kept_seconds, 4),
                "reencode_prefill": full.prefilled_tokens,
                "reencode_seconds": round(fresh_seconds, 4),
            }
        )
    backend.close(kept.session_id)
    return rows


def _target(event: Any) -> str | None:
    for name in ("tool_call_id", "owner", "branch"):
        value = getattr(event, name, None)
        if value:
            return str(value)
    return None


def _print_run(title: str, result: dict[str, Any]) -> None:
    print(f"\n== {title}")
    by_state: dict[str, int] = result["stats"]["tokens_by_state"]
    print(f"events sent: {len(result['events'])}; tokens by state: {by_state}")
    print(
        f"session device KV bytes at the end: {result['stats']['device_bytes']:,} "
        f"(peak {result['stats']['peak_device_bytes']:,})"
    )
    print(f"host bytes: {result['stats']['host_bytes']:,}; forced calls repaired: {result['repaired']}")


if __name__ == "__main__":
    off = main(measure=True, thread_id="tool-assistant-no-budget")
    print(
        "per model call: prefill tokens / seconds (~ time to first token), "
        "ChatAgentKV incremental vs re-encoding the history"
    )
    print(f"{'call':>4} {'history':>8} {'incr':>6} {'incr s':>8} {'re-enc':>7} {'re-enc s':>9}")
    for row in off["reuse"]:
        print(
            f"{row['call']:>4} {row['history_tokens']:>8} {row['incremental_prefill']:>6} "
            f"{row['incremental_seconds']:>8.3f} {row['reencode_prefill']:>7} {row['reencode_seconds']:>9.3f}"
        )
    total_inc = sum(r["incremental_prefill"] for r in off["reuse"])
    total_full = sum(r["reencode_prefill"] for r in off["reuse"])
    print(f"total prefill: {total_inc} tokens incremental vs {total_full} re-encoded")
    _print_run("lifecycle, no budget", off)
    on = main(device_tokens=768, thread_id="tool-assistant-budget")
    _print_run("lifecycle, device budget 768 tokens", on)
    print("\nspans after the budgeted run (kind, owner, state, tier):")
    for span in on["spans"]:
        print(
            f"  {span['kind']:<12} {str(span['owner'])[:24]:<24} {span['state']:<10} "
            f"{span['tier']:<8} {span['tokens']:>5}"
        )
