"""LangChain integration for agentkv.

`ChatAgentKV` is a chat model whose KV cache lives across an agent's calls;
`KVLifecycleCallbackHandler` turns the agent's runs into lifecycle events on the
same sessions.
"""

from agentkv_langchain.callbacks import KVLifecycleCallbackHandler
from agentkv_langchain.chat_models import ChatAgentKV
from agentkv_langchain.sessions import SessionKey, session_for
from agentkv_langchain.tools import parse_tool_calls, render_tool_prompt

__all__ = [
    "ChatAgentKV",
    "KVLifecycleCallbackHandler",
    "SessionKey",
    "parse_tool_calls",
    "render_tool_prompt",
    "session_for",
]
