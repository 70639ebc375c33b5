"""LangChain's standard integration suite for `ChatAgentKV` on the default model (SmolLM2-135M).

The model is loaded once per module. Answers are short (`max_new_tokens=24`) to keep
the module fast on two CPU cores. Capability flags are what the code supports; the
tests that need a stronger model than 135M parameters (exact tool arguments, tool
calls it was not forced to make) are marked `xfail` with what the model does instead.
Structured output passes in every form: decoding is grammar-constrained, so the call
follows the schema and closes inside the token budget.
Decoding is greedy, so what passes and what fails is the same on every run.
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests

from agentkv import TransformersBackend, load_model
from agentkv_langchain import ChatAgentKV

pytestmark = [
    pytest.mark.integration,
    # The standard suite's async tests expect pytest-asyncio's "auto" mode; this project
    # runs in strict mode, so the module marks them (and silences the mark on sync tests).
    pytest.mark.asyncio,
    pytest.mark.filterwarnings("ignore:The test <Function:pytest.PytestWarning"),
]

_BACKEND: TransformersBackend | None = None

EXACT_ARGS = "SmolLM2-135M: the call parses under the grammar, but the argument is not always the asked value"
UNFORCED_CALL = "SmolLM2-135M: answers in prose when a tool call is not forced (tool_choice=None)"


BOTH_OUTPUT_VERSIONS = pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
"""The parent's parametrization, repeated: an override does not inherit its marks."""


@pytest.fixture(scope="module", autouse=True)
def default_backend() -> TransformersBackend:
    global _BACKEND
    model, tokenizer = load_model(device="cpu")
    _BACKEND = TransformersBackend(model, tokenizer)
    return _BACKEND


class TestChatAgentKVDefaultModel(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatAgentKV]:
        return ChatAgentKV

    @property
    def chat_model_params(self) -> dict[str, Any]:
        assert _BACKEND is not None, "the default_backend fixture loads it first"
        return {"backend": _BACKEND, "max_new_tokens": 24}

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def structured_output_kwargs(self) -> dict[str, Any]:
        return {"method": "function_calling"}

    @property
    def supports_json_mode(self) -> bool:
        return False  # no constrained decoding

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[Any]]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    @property
    def supports_model_override(self) -> bool:
        return False  # one in-process model per backend

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def supports_image_tool_message(self) -> bool:
        return False

    @property
    def supports_pdf_inputs(self) -> bool:
        return False

    @property
    def supports_pdf_tool_message(self) -> bool:
        return False

    @property
    def supports_audio_inputs(self) -> bool:
        return False

    @property
    def supports_anthropic_inputs(self) -> bool:
        return False

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        # The same history twice on one session: the second call reads it from the cache.
        llm = self.chat_model_class(**{**self.chat_model_params, "session_id": "cache-read"})
        messages = [
            HumanMessage("Remember: the code is 4417."),
            AIMessage("Noted."),
            HumanMessage("The code?"),
        ]
        llm.invoke(messages)
        if not stream:
            return llm.invoke(messages)
        full: Any = None
        for chunk in llm.stream(messages):
            full = chunk if full is None else full + chunk
        return full

    # -- what a 135M model cannot do --------------------------------------------------------------

    @pytest.mark.xfail(reason=EXACT_ARGS, strict=False)
    @BOTH_OUTPUT_VERSIONS
    def test_tool_calling(self, model: Any) -> None:
        super().test_tool_calling(model)

    @pytest.mark.xfail(reason=EXACT_ARGS, strict=False)
    async def test_tool_calling_async(self, model: Any) -> None:
        await super().test_tool_calling_async(model)

    @pytest.mark.xfail(reason=UNFORCED_CALL, strict=False)
    @BOTH_OUTPUT_VERSIONS
    def test_agent_loop(self, model: Any) -> None:
        super().test_agent_loop(model)


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"It is sunny in {city}."


def test_three_call_conversation_with_a_forced_tool() -> None:
    assert _BACKEND is not None
    llm = ChatAgentKV(backend=_BACKEND, session_id="three-calls", max_new_tokens=24)
    tooled = llm.bind_tools([get_weather], tool_choice="get_weather")
    messages: list[Any] = [HumanMessage("What is the weather in Paris?")]

    call = tooled.invoke(messages)
    assert call.tool_calls, call.invalid_tool_calls
    assert call.tool_calls[0]["name"] == "get_weather"
    messages += [call, ToolMessage(get_weather("Paris"), tool_call_id=call.tool_calls[0]["id"])]

    answer = llm.bind_tools([get_weather]).invoke(messages)
    assert isinstance(answer, AIMessage)
    usage = answer.usage_metadata
    assert usage is not None
    # The call (and everything before it) came from the cache: only the tool result was new.
    assert answer.response_metadata["cropped_tokens"] == 0
    assert usage["input_token_details"]["cache_read"] > 0
    messages += [answer, HumanMessage("And in Rome?")]

    again = tooled.invoke(messages)
    assert again.tool_calls and again.tool_calls[0]["name"] == "get_weather"
    assert again.response_metadata["cropped_tokens"] == 0
    _BACKEND.get("three-calls").check()
