"""LangChain integration for agentkv.

`ChatAgentKV` is a chat model whose KV cache lives across an agent's calls;
`KVLifecycleCallbackHandler` turns the agent's runs into lifecycle events on the
same sessions; `AgentKVMiddleware` does the same from inside a
`langchain.agents.create_agent` agent (it needs LangChain's agents, the `agents`
extra, so it is imported on first use: `from agentkv_langchain import
AgentKVMiddleware` raises an `ImportError` naming the extra when they are absent).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentkv_langchain.callbacks import KVLifecycleCallbackHandler
from agentkv_langchain.chat_models import ChatAgentKV
from agentkv_langchain.sessions import SessionKey, session_for
from agentkv_langchain.tools import parse_tool_calls, render_tool_prompt

if TYPE_CHECKING:
    from agentkv_langchain.middleware import AgentKVMiddleware

__all__ = [
    "AgentKVMiddleware",
    "ChatAgentKV",
    "KVLifecycleCallbackHandler",
    "SessionKey",
    "parse_tool_calls",
    "render_tool_prompt",
    "session_for",
]


def __getattr__(name: str) -> Any:
    # `langchain` (the agents package) is an optional extra: import the middleware only when asked.
    if name == "AgentKVMiddleware":
        from agentkv_langchain.middleware import AgentKVMiddleware

        return AgentKVMiddleware
    msg = f"module 'agentkv_langchain' has no attribute {name!r}"
    raise AttributeError(msg)
