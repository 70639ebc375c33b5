"""The tool-using research assistant of `agentkv demo` and `examples/tool_assistant.py`.

A LangGraph `StateGraph`: the model node ⇄ a `ToolNode` with two tools, driven by a
scripted conversation of twelve user turns. On the turns that need a tool the model
is forced to call it (`tool_choice=<tool>`, decoded under the tool's grammar, so even
the 135M default model's call parses and follows its schema); the tool returns a long
result (snippets plus boilerplate, as real tools do) and the model answers from it.
One lookup names an unknown record and fails, so the conversation has every moment
the lifecycle cares about: completed calls, a failed call, turn ends.

It lives in the shipped package (not in `examples/`, which is not a package) so that
`agentkv demo` runs from an installed wheel; the example script imports it from here.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Annotated, Any

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import InjectedState, ToolNode, tools_condition
from typing_extensions import TypedDict

__all__ = [
    "RECALL_QUESTIONS",
    "RECORDS",
    "SCRIPT",
    "SYSTEM",
    "TOOLS",
    "TOPICS",
    "RecallQuestion",
    "State",
    "Turn",
    "build_graph",
    "lookup",
    "search",
    "turn_input",
]

SYSTEM = (
    "You are a concise research assistant. "
    "Use a tool when asked, then answer in one sentence from its result."
)
"""The system prompt (the tool prompt is appended to it by `ChatAgentKV.bind_tools`)."""

TOPICS: dict[str, list[str]] = {
    "eiffel": [
        "The Eiffel Tower in Paris was completed in 1889 for the World's Fair.",
        "It is 330 metres tall and was the tallest man-made structure for 41 years.",
        "Gustave Eiffel's company designed and built it with about 18,000 iron parts.",
    ],
    "coffee": [
        "Coffee plants originated in Ethiopia; the drink spread through Yemen in the 15th century.",
        "Arabica and robusta are the two main species grown commercially.",
        "Brazil is the largest producer, followed by Vietnam and Colombia.",
    ],
    "rust": [
        "Rust is a systems programming language first released as 1.0 in 2015.",
        "Its ownership model guarantees memory safety without a garbage collector.",
        "Cargo is Rust's build tool and package manager; crates are hosted on crates.io.",
    ],
    "mars": [
        "Mars has two small moons, Phobos and Deimos.",
        "Olympus Mons on Mars is the tallest known volcano in the solar system.",
        "A Martian day, a sol, lasts about 24 hours and 39 minutes.",
    ],
}
"""What `search` finds, per topic."""

RECORDS: dict[str, str] = {
    "order-1042": "Order 1042: 3 notebooks, shipped 2024-05-02, tracking ZX-99, delivered to Lyon.",
    "order-2077": "Order 2077: 1 espresso machine, shipped 2024-06-11, tracking QP-17, in transit.",
}
"""What `lookup` finds; any other id fails."""


@dataclass(frozen=True)
class Turn:
    """One scripted user turn."""

    text: str
    tool: str | None = None
    """The tool the model is forced to call on this turn (None = answer directly)."""
    topic: str = ""
    """What the tool works on (search topic or record id), read by the tools from the graph state."""


SCRIPT: tuple[Turn, ...] = (
    Turn("Please search for facts about the Eiffel Tower.", "search", "eiffel"),
    Turn("Thanks. In which year was it completed?"),
    Turn("Look up order-1042 for me.", "lookup", "order-1042"),
    Turn("Which city was that order delivered to?"),
    Turn("Search for the history of coffee.", "search", "coffee"),
    Turn("Look up order-9999 please.", "lookup", "order-9999"),
    Turn("Never mind that one. Which country grows the most coffee?"),
    Turn("Search for facts about the Rust language.", "search", "rust"),
    Turn("What is Cargo?"),
    Turn("Search for facts about Mars.", "search", "mars"),
    Turn("How long is a day on Mars?"),
    Turn("Look up order-2077.", "lookup", "order-2077"),
)
"""The conversation; runs longer than the script repeat it from the start."""


@dataclass(frozen=True)
class RecallQuestion:
    """A question about an early fact, asked after the conversation, completion style.

    The answer is generated after `prefix` (the start of the assistant's reply), so
    even the 135M default model copies the fact from its context instead of chatting.
    """

    question: str
    prefix: str
    gold: str
    """The fact, as it appears in the tool result (for a contains-check, not exact match)."""


RECALL_QUESTIONS: tuple[RecallQuestion, ...] = (
    RecallQuestion(
        "In which year was the Eiffel Tower completed?",
        'The search result says: "The Eiffel Tower in Paris was completed in',
        "1889",
    ),
    RecallQuestion(
        "Which city was order-1042 delivered to?",
        'The order record says it was "delivered to',
        "Lyon",
    ),
)
"""Facts from the first turns' tool results: by the end they are long committed (and, under a
budget, archived), so answering them needs the cache to have kept them or recall to bring them back."""


class State(TypedDict):
    """Graph state: the conversation and what the current turn asks of the tools."""

    messages: Annotated[list[AnyMessage], add_messages]
    tool: str | None
    topic: str
    repaired: Annotated[int, operator.add]
    """Forced calls whose arguments did not parse, over the whole thread (summed by the reducer)."""


@tool
def search(state: Annotated[dict[str, Any], InjectedState], query: str = "") -> str:
    """Search the web and return the top results."""
    facts = TOPICS.get(state.get("topic", ""), ["No results."])
    lines = [
        f"Result {i + 1}: {fact} Source: encyclopedia entry {i + 1}, retrieved today."
        for i, fact in enumerate(facts)
    ]
    # Long results, as real search tools return: snippets plus boilerplate the model does not need.
    filler = " ".join(f"Related link {j}: more pages about {query or 'this topic'}." for j in range(12))
    return "\n".join([f"Search results for {query or state.get('topic')!r}:", *lines, filler])


@tool
def lookup(state: Annotated[dict[str, Any], InjectedState], record_id: str = "") -> str:
    """Look up an order record by its id."""
    key = state.get("topic", "")
    if key not in RECORDS:
        msg = f"no record {key!r}"
        raise KeyError(msg)
    history = " ".join(f"Status update {j}: scanned at depot {j}." for j in range(10))
    return f"{RECORDS[key]}\n{history}"


TOOLS = [search, lookup]
"""The tools the model may call, in the order they are described to it."""


def turn_input(index: int) -> dict[str, Any]:
    """The graph input of scripted turn `index` (0-based; the script repeats past its end)."""
    turn = SCRIPT[index % len(SCRIPT)]
    return {"messages": [HumanMessage(turn.text)], "tool": turn.tool, "topic": turn.topic}


def build_graph(llm: BaseChatModel) -> Any:
    """The agent: model ⇄ tools, with the tool choice scripted per turn.

    Args:
        llm: A chat model with `bind_tools` (`ChatAgentKV`, or a baseline over the same model).

    Returns:
        The compiled graph, with an in-memory checkpointer (one history per `thread_id`).
    """

    def agent(state: State, config: RunnableConfig) -> dict[str, Any]:
        forced = state.get("tool") if isinstance(state["messages"][-1], HumanMessage) else None
        model = llm.bind_tools(TOOLS, tool_choice=forced or "none")
        answer = model.invoke([SystemMessage(SYSTEM), *state["messages"]], config)
        if forced and isinstance(answer, AIMessage) and not answer.tool_calls:
            # A forced call whose arguments did not parse: call the tool with its defaults.
            # The session then re-encodes this message (it differs from what was generated).
            call = {"name": forced, "args": {}, "id": f"call_{answer.id}", "type": "tool_call"}
            answer = AIMessage(content="", tool_calls=[call], id=answer.id)
            return {"messages": [answer], "repaired": 1}
        return {"messages": [answer], "repaired": 0}

    builder = StateGraph(State)
    builder.add_node("agent", agent)
    builder.add_node("tools", ToolNode(TOOLS, handle_tool_errors=True))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition, ["tools", END])
    builder.add_edge("tools", "agent")
    return builder.compile(checkpointer=InMemorySaver())
