"""One call's plan: LangChain's call arguments (messages, stop, bound kwargs) → a `CallPlan`.

`ChatAgentKV` inherits `CallPlanning`: sampling options, tool choice, and the tools
block (through the chat template or the system prompt) are decided here, before
the session is touched.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from langchain_core.messages import AIMessage, BaseMessage, ToolMessage

from agentkv import AnySession, Backend, Session
from agentkv.grammar import json_grammar, text_grammar
from agentkv.toolformats import JsonCallFormat
from agentkv_langchain.calls import CallPlan
from agentkv_langchain.messages import to_chat_dicts
from agentkv_langchain.tools import (
    ANY_TOOL,
    forced_call_prefix,
    render_tool_prompt,
    resolve_tool_choice,
    tool_names,
    tool_parameters,
)
from agentkv_langchain.toolset import thread_tools

__all__ = ["IGNORED_KWARGS", "SAMPLING_KWARGS", "CallPlanning", "call_then_answer_choice", "repeated_calls"]

SAMPLING_KWARGS = ("max_new_tokens", "max_tokens", "temperature", "top_p", "top_k", "seed")
IGNORED_KWARGS = ("strict",)
"""Accepted and ignored: with the grammar on, calls always follow their schema (strict or not)."""
GRAMMAR_KWARGS = ("parallel_tool_calls", "response_format")
"""`parallel_tool_calls=True` lets a constrained answer make several calls (default: one);
`response_format` (a JSON schema, or `{"type": "json_object"}`) constrains the answer to JSON."""


class CallPlanning:
    """The planning half of `ChatAgentKV` (its fields are read from the model)."""

    if TYPE_CHECKING:
        backend: Backend
        model_name: str | None
        max_new_tokens: int
        temperature: float
        top_p: float
        top_k: int
        seed: int | None
        stop: list[str] | None
        tool_use: Literal["auto", "call_then_answer"]
        grammar: bool

    # -- one call's plan ----------------------------------------------------------------------

    def _plan(
        self,
        messages: Sequence[BaseMessage],
        stop: list[str] | None,
        kwargs: Mapping[str, Any],
        session: AnySession | None = None,
    ) -> CallPlan:
        """Turn LangChain's call (messages, stop, bound kwargs) into what the session needs.

        With a session, the thread keeps the tools block it started with and a changed
        tool set becomes a note (see `agentkv_langchain.toolset`).
        """
        if not messages:
            msg = (
                "ChatAgentKV: no messages to answer; pass the conversation, at least one message "
                "(e.g. [HumanMessage('...')]); in a graph, the state's messages reached the model empty"
            )
            raise ValueError(msg)
        options = dict(kwargs)
        tools: list[dict[str, Any]] = list(options.pop("tools", None) or [])
        choice = resolve_tool_choice(options.pop("tool_choice", None), tool_names(tools))
        requested = options.pop("model", None)
        if requested is not None and requested != self.model_name:
            msg = (
                f"model={requested!r}: ChatAgentKV serves the in-process model {self.model_name!r}; "
                "build another ChatAgentKV (with its own backend) for another model"
            )
            raise ValueError(msg)
        for key in IGNORED_KWARGS:
            options.pop(key, None)
        parallel = options.pop("parallel_tool_calls", None) is True
        response_format = options.pop("response_format", None)
        sampling: dict[str, Any] = {
            "max_new_tokens": options.pop("max_tokens", options.pop("max_new_tokens", self.max_new_tokens)),
            "temperature": options.pop("temperature", self.temperature),
            "top_p": options.pop("top_p", self.top_p),
            "top_k": options.pop("top_k", self.top_k),
            "seed": options.pop("seed", self.seed),
            "stop": list(stop if stop is not None else self.stop or []),
        }
        if options:
            allowed = ", ".join(
                ("tools", "tool_choice", "model", *SAMPLING_KWARGS, *IGNORED_KWARGS, *GRAMMAR_KWARGS)
            )
            msg = f"ChatAgentKV: unknown call argument(s) {', '.join(sorted(options))}; allowed: {allowed}"
            raise ValueError(msg)
        chat = to_chat_dicts(messages)
        if tools and choice is None and self.tool_use == "call_then_answer" and chat:
            choice = call_then_answer_choice(chat, tools)
        chat_format = self.backend.chat_format
        fmt = chat_format.tool_format
        block = tools
        if session is not None:
            chat, block = thread_tools(session).plan(chat, tools, fmt)
        if block:
            chat = self._with_tools(chat, block)
        # No call when none is wanted, or when the prompt lists tools but none are bound now.
        ban = (bool(tools) and choice == "none") or (not tools and bool(block))
        constrained = self.grammar and (session is None or isinstance(session, Session))
        grammar, prefix = None, ""
        specials = chat_format.grammar_specials if constrained else {}
        if tools and choice not in (None, "none"):
            close = fmt.call_close.strip() if isinstance(fmt, JsonCallFormat) else ""
            if not constrained and close:  # the grammar ends the call itself; its strings may hold the tag
                sampling["stop"].append(close)
            if constrained:  # the call follows the tool's schema; "any": the model picks the name under it
                forced = tools if choice == ANY_TOOL else [t for t in tools if tool_names([t]) == [choice]]
                grammar = fmt.grammar(forced, "forced", parallel=parallel, specials=specials)
                prefix = fmt.opening(None if choice == ANY_TOOL else str(choice))
            elif choice != ANY_TOOL:
                prefix = forced_call_prefix(choice, tool_parameters(tools, choice), fmt)
        elif constrained and response_format is not None:
            grammar = json_grammar(response_schema(response_format))
        elif constrained and tools and choice is None:
            grammar = fmt.grammar(tools, "auto", parallel=parallel, specials=specials)
        elif constrained and ban:
            grammar = text_grammar()
        return CallPlan(
            messages=chat,
            tools=tools,
            prefix=prefix,
            sampling=sampling,
            choice=choice,
            ban_calls=ban,
            grammar=grammar,
            parallel=parallel,
        )

    def _answered_already(
        self, messages: Sequence[BaseMessage], kwargs: Mapping[str, Any], calls: Sequence[Mapping[str, Any]]
    ) -> bool:
        """Whether `tool_use="call_then_answer"` forced `calls` that the thread already holds results of."""
        forced_here = self.tool_use == "call_then_answer" and "tool_choice" not in kwargs
        return forced_here and repeated_calls(messages, calls)

    def _with_tools(self, chat: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Describe the tools: through the chat template when it can, else in the system prompt.

        The tool prompt goes *after* the system prompt's own text, so a conversation that
        starts without tools and gains them later keeps its system prompt's tokens cached.
        Only message 0 carries the tools block: a system message further on (a tool-set
        note) is left as it is, and a chat that starts with another role gets a system
        message of its own in front, call after call, so its cached prefix stays valid.
        """
        chat = list(chat)
        if self.backend.chat_format.tools_in_template:
            chat[0] = {**chat[0], "tools": tools}
            return chat
        prompt = render_tool_prompt(tools, self.backend.chat_format.tool_format)
        if not chat or chat[0]["role"] != "system":
            chat.insert(0, {"role": "system", "content": prompt})
        else:
            own = chat[0]["content"]
            chat[0] = {**chat[0], "content": f"{own}\n\n{prompt}" if own else prompt}
        return chat


def call_then_answer_choice(chat: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]]) -> str | None:
    """`tool_use="call_then_answer"`'s tool choice for a call whose conversation is `chat`.

    A user message gets a call ("any": to the tool the model picks), a tool result a
    text answer ("none"). A forced call that repeats one the thread already holds the
    result of is answered from that result instead (`repeated_calls`).
    """
    last = chat[-1]["role"]
    if last == "tool":
        return "none"
    return resolve_tool_choice("any", tool_names(tools)) if last == "user" else None


def repeated_calls(messages: Sequence[BaseMessage], calls: Sequence[Mapping[str, Any]]) -> bool:
    """Whether every one of `calls` (name and arguments) was already made in `messages` and answered.

    Booking the same room again or fetching the same log again for a follow-up question:
    the thread already holds that call's result, so the answer should come from it.
    """
    answered = {m.tool_call_id for m in messages if isinstance(m, ToolMessage)}
    made = {
        (c["name"], json.dumps(c["args"], sort_keys=True))
        for m in messages
        if isinstance(m, AIMessage)
        for c in m.tool_calls
        if c.get("id") in answered
    }
    return bool(calls) and all((c["name"], json.dumps(c["args"], sort_keys=True)) in made for c in calls)


def response_schema(response_format: Any) -> dict[str, Any] | None:
    """The JSON schema of a `response_format` (None: any JSON object).

    Accepted: `{"type": "json_object"}`, `{"type": "json_schema", "json_schema": {"schema": ...}}`
    (OpenAI's form), or a JSON schema itself.

    Raises:
        ValueError: none of these forms.
    """
    if isinstance(response_format, Mapping):
        kind = response_format.get("type")
        if kind == "json_object":
            return None
        if kind == "json_schema" and isinstance(response_format.get("json_schema"), Mapping):
            schema = response_format["json_schema"].get("schema")
            if isinstance(schema, Mapping):
                return dict(schema)
        elif kind != "json_schema":
            return dict(response_format)
    expected = '{"type": "json_object"}, {"type": "json_schema", "json_schema": {"schema": ...}}'
    msg = f"response_format: expected {expected} or a JSON schema, got {response_format!r:.80}"
    raise ValueError(msg)
