"""LangChain integration: `ChatAgentKV`, a chat model whose KV cache lives across an agent's calls."""

from agentkv_langchain.chat_models import ChatAgentKV
from agentkv_langchain.sessions import SessionKey, session_for
from agentkv_langchain.tools import parse_tool_calls, render_tool_prompt

__all__ = ["ChatAgentKV", "SessionKey", "parse_tool_calls", "render_tool_prompt", "session_for"]
