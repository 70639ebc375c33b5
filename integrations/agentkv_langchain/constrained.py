"""Constrained decoding for `ChatAgentKV`: bind-time checks, the answer's processor, structured output.

The grammars themselves are built by `agentkv.grammar` from the bound tools or the
schema (`CallPlanning._plan` picks which); this module connects them to LangChain.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from operator import itemgetter
from typing import Any, Literal

from langchain_core.language_models import LanguageModelInput
from langchain_core.output_parsers import (
    BaseOutputParser,
    JsonOutputKeyToolsParser,
    JsonOutputParser,
    PydanticOutputParser,
    PydanticToolsParser,
)
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass

from agentkv import Backend
from agentkv.grammar import GrammarProcessor, compile_grammar
from agentkv.grammar.grammars import check_schema

__all__ = [
    "STRUCTURED_METHODS",
    "StructuredOutput",
    "check_tool_schemas",
    "grammar_processor",
    "structured_output",
]

STRUCTURED_METHODS = ("function_calling", "json_schema", "json_mode")
"""`with_structured_output` methods: a constrained call to a tool made of the schema; constrained
JSON following the schema; constrained JSON of any object (parsed, then validated if a class)."""


def check_tool_schemas(tools: Sequence[Mapping[str, Any]], where: str = "bind_tools") -> None:
    """Raise `GrammarError` (a `ValueError`) naming the tool when its parameters cannot become a grammar."""
    for i, tool in enumerate(tools):
        function = tool.get("function", {})
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        check_schema(parameters, f"{where}: tools[{i}] ({function.get('name')!r}).parameters")


def grammar_processor(
    backend: Backend, lark: str, prefix: str, budget: int | None, *, ends_at_call_close: bool = False
) -> GrammarProcessor:
    """A processor for one answer under `lark` (compiled once), advanced through the prefilled `prefix`.

    `budget` (the answer's `max_new_tokens`) makes it close the answer before the budget cuts it.
    `ends_at_call_close`: decoding stops when the call's JSON closes (`CallEnd`), so the
    budget need not hold what the format writes after it (`call_tail`) and the end of turn.
    """
    fmt = backend.chat_format
    stops = fmt.stop_token_ids()
    compiled = compile_grammar(backend.tokenizer, stops, lark, where="answer grammar")
    prefix_ids = fmt.encode(prefix) if prefix else []
    tail = fmt.encode(fmt.tool_format.call_tail) if ends_at_call_close else []
    return GrammarProcessor(
        compiled, prefix_ids, budget=budget, tokenizer=backend.tokenizer, stop_ids=stops, tail_ids=tail
    )


def structured_output(
    model: Any,
    schema: dict[str, Any] | type,
    *,
    method: Literal["function_calling", "json_schema", "json_mode"] = "function_calling",
    include_raw: bool = False,
    strict: bool | None = None,
) -> Runnable[LanguageModelInput, Any]:
    """`ChatAgentKV.with_structured_output`: the model bound to answer as `schema`, and its parser.

    Raises:
        ValueError: an unknown method, `strict=True` with the grammar off, or a schema the
            grammar library cannot express (the message names the schema).
    """
    if method not in STRUCTURED_METHODS:
        msg = f"with_structured_output: method must be one of {', '.join(STRUCTURED_METHODS)}, got {method!r}"
        raise ValueError(msg)
    if strict and not model.grammar:
        msg = "with_structured_output(strict=True) needs constrained decoding; it is off (grammar=False)"
        raise ValueError(msg)
    is_class = isinstance(schema, type) and is_basemodel_subclass(schema)
    traced = {"kwargs": {"method": method}, "schema": schema}
    parser: BaseOutputParser[Any]
    if method == "function_calling":
        tool = convert_to_openai_tool(schema)
        llm = model.bind_tools([tool], tool_choice="any", ls_structured_output_format=traced)
        if is_class:
            parser = PydanticToolsParser(tools=[schema], first_tool_only=True)  # type: ignore[list-item]
        else:
            parser = JsonOutputKeyToolsParser(key_name=tool["function"]["name"], first_tool_only=True)
    else:
        json_schema = convert_to_json_schema(schema) if method == "json_schema" else None
        if json_schema is not None and model.grammar:
            check_schema(json_schema, f"with_structured_output: schema {json_schema.get('title', '')!r}")
        response_format = {"type": "json_object"} if json_schema is None else json_schema
        llm = model.bind(response_format=response_format, ls_structured_output_format=traced)
        parser = (
            PydanticOutputParser(pydantic_object=schema)  # type: ignore[arg-type]
            if is_class
            else JsonOutputParser()
        )
    if not include_raw:
        return llm | parser
    parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
    fallback = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback], exception_key="parsing_error")


class StructuredOutput:
    """`with_structured_output` for `ChatAgentKV` (a mixin: it reads `grammar` and binds on the model)."""

    def with_structured_output(
        self,
        schema: dict[str, Any] | type,
        *,
        include_raw: bool = False,
        method: Literal["function_calling", "json_schema", "json_mode"] = "function_calling",
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | Any]:
        """The model answering as `schema` (pydantic class, TypedDict or JSON schema), parsed.

        With `grammar` on, every method is constrained: "function_calling" forces a call to a
        tool made of the schema, "json_schema" decodes JSON that follows the schema, "json_mode"
        any JSON object. `include_raw=True` returns `{"raw", "parsed", "parsing_error"}`;
        `strict=True` needs the grammar (it is always strict).

        Raises:
            ValueError: unknown arguments, or see `structured_output`.
        """
        if kwargs:
            msg = f"with_structured_output: unknown argument(s) {', '.join(sorted(kwargs))}"
            raise ValueError(msg)
        return structured_output(self, schema, method=method, include_raw=include_raw, strict=strict)
