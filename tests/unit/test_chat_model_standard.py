"""LangChain's standard unit suite for `ChatAgentKV`, on the tiny random Llama.

The suite builds the model from `chat_model_params` (a property, not a fixture), so
the tiny backend is built once by a module fixture and kept in a module global.
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain_tests.unit_tests import ChatModelUnitTests

from agentkv import AgentKVConfig, TransformersBackend
from agentkv_langchain import ChatAgentKV

_BACKEND: TransformersBackend | None = None


@pytest.fixture(scope="module", autouse=True)
def tiny_backend(tiny_model, tiny_tokenizer) -> TransformersBackend:
    global _BACKEND
    _BACKEND = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig(policy="full"))
    return _BACKEND


class TestChatAgentKVUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatAgentKV]:
        return ChatAgentKV

    @property
    def chat_model_params(self) -> dict[str, Any]:
        assert _BACKEND is not None, "the tiny_backend fixture builds it first"
        return {"backend": _BACKEND, "max_new_tokens": 8}

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        # BaseChatModel.with_structured_output on top of bind_tools(tool_choice="any"),
        # whose call opening is prefilled.
        return True

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[Any]]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    @property
    def supports_model_override(self) -> bool:
        return False  # one in-process model per backend
