"""The lifecycle handler as a plain LangChain callback: a ChatAgentKV + tool loop, no LangGraph.

One agent turn is a `RunnableLambda` that calls the model, runs the tools it asks
for and calls the model again. `KVLifecycleCallbackHandler` is passed in the run's
`callbacks`; every call inside the turn inherits it (and the `thread_id` metadata
that picks the session). The handler sees the tool runs and the end of the turn:
a tool result is committed and its call released (a failed call too: its error text is kept); the
end of the top-level run ends the turn. Run `python examples/plain_langchain.py`.
"""

from __future__ import annotations

from typing import Any

from langchain_core.messages import BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.runnables import RunnableConfig, RunnableLambda
from langchain_core.tools import tool

from agentkv import TransformersBackend
from agentkv_langchain import ChatAgentKV
from agentkv_langchain.callbacks import KVLifecycleCallbackHandler
from agentkv_langgraph import shared_backend

SYSTEM = "You are a helpful assistant with a weather tool. Answer in one short sentence."
WEATHER = {
    "paris": "Paris: sunny, 24 C, light wind from the west, humidity 40 percent, UV index 6.",
    "oslo": "Oslo: rain showers, 11 C, strong wind from the north, humidity 85 percent.",
}
SCRIPT: tuple[tuple[str, str | None], ...] = (
    ("What is the weather in Paris?", "paris"),
    ("Should I take sunglasses there?", None),
    ("And the weather in Atlantis?", "atlantis"),
    ("What about Oslo?", "oslo"),
    ("Which of the two cities is warmer?", None),
)
"""(user message, the city the weather tool is asked about, or None when no tool is needed)."""


def make_weather_tool(cities: list[str]) -> Any:
    """A weather tool; it reports on the current turn's city (`cities[-1]`), whatever the model wrote."""

    @tool
    def weather(city: str = "") -> str:
        """Current weather report for a city."""
        key = cities[-1] if cities else city.lower()
        if key not in WEATHER:
            msg = f"unknown city {key!r}"
            raise ValueError(msg)
        return WEATHER[key] + " " + " ".join(f"Hour {h}: stable." for h in range(8))

    return weather


def main(
    backend: TransformersBackend | None = None,
    turns: int = len(SCRIPT),
    *,
    max_new_tokens: int = 32,
    thread_id: str = "plain-langchain",
) -> dict[str, Any]:
    """Run the scripted turns through a plain LangChain loop; return what happened.

    Args:
        backend: The model's backend; None = the default model.
        turns: How many scripted turns (the script repeats past its end).
        max_new_tokens: Length limit of each answer.
        thread_id: The session (passed as `metadata={"thread_id": ...}`).

    Returns:
        `events`, `spans` (span map after the run), `tool_calls` (call id → "ok" / "failed"),
        `stats`, `handler_errors`.
    """
    backend = backend or shared_backend()
    handler = KVLifecycleCallbackHandler(backend)
    llm = ChatAgentKV(backend=backend, max_new_tokens=max_new_tokens)
    cities: list[str] = []
    weather = make_weather_tool(cities)
    history: list[BaseMessage] = [SystemMessage(SYSTEM)]
    outcomes: dict[str, str] = {}

    def agent_turn(inputs: dict[str, Any], config: RunnableConfig) -> str:
        history.append(HumanMessage(inputs["text"]))
        city = inputs["city"]
        if city is not None:
            cities.append(city)
            # A named choice decodes under that tool's JSON-schema grammar: the call always parses.
            ai = llm.bind_tools([weather], tool_choice="weather").invoke(history, config)
            history.append(ai)
            for call in ai.tool_calls:
                try:
                    result: ToolMessage = weather.invoke({**call, "type": "tool_call"}, config)
                    outcomes[str(call["id"])] = "ok"
                except ValueError as e:  # the handler already sent ToolCallFailed (on_tool_error)
                    result = ToolMessage(f"Error: {e}", tool_call_id=str(call["id"]), status="error")
                    outcomes[str(call["id"])] = "failed"
                history.append(result)
        answer = llm.bind_tools([weather], tool_choice="none").invoke(history, config)
        history.append(answer)
        return str(answer.content)

    turn = RunnableLambda(agent_turn, name="agent_turn")
    run_config: RunnableConfig = {"callbacks": [handler], "metadata": {"thread_id": thread_id}}
    answers = [
        turn.invoke({"text": t, "city": c}, run_config)
        for t, c in (SCRIPT[i % len(SCRIPT)] for i in range(turns))
    ]
    session = backend.get(thread_id)
    snapshot = session.snapshot()
    return {
        "answers": answers,
        "events": [(sid, type(e).__name__, getattr(e, "tool_call_id", None)) for sid, e in handler.events],
        "spans": [
            {k: s[k] for k in ("span_id", "kind", "owner", "state", "tier", "tokens")}
            for s in snapshot["spans"]
        ],
        "tool_calls": outcomes,
        "stats": snapshot["stats"],
        "handler_errors": handler.errors,
    }


if __name__ == "__main__":
    result = main()
    for name, count in sorted(
        {e[1]: sum(1 for x in result["events"] if x[1] == e[1]) for e in result["events"]}.items()
    ):
        print(f"{name}: {count}")
    by_owner = {s["owner"]: s for s in result["spans"]}
    for call_id, outcome in result["tool_calls"].items():
        span = by_owner.get(call_id)
        print(f"tool call {call_id}: {outcome}; its result span is {span['state'] if span else 'absent'}")
    print("tokens by state:", result["stats"]["tokens_by_state"])
    print(f"prefill {result['stats']['prefill_tokens']} tokens, reused {result['stats']['reused_tokens']}")
