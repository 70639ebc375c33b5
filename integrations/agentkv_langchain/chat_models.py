"""`ChatAgentKV`: a LangChain chat model over an agentkv session.

Every call hands the **whole** message list to `Session.extend`; the session
matches it with what its KV cache already holds, message by message, and encodes
only the new suffix. So an agent that re-sends its growing history each turn pays
only for the new messages, not for the history (what `langchain-huggingface`
re-encodes every time).

Three things keep that match exact, call after call:

- The tool prompt (for chat templates without tool support) is a pure function of
  the bound tools (`tools.render_tool_prompt`), so the system message renders to
  the same tokens each time.
- The answer is bound to the session as the exact `AIMessage` the caller gets back
  (content, tool calls with their fresh ids), so when the agent sends it back the
  session recognises it and keeps the token ids the model produced instead of
  re-tokenising its text.
- The `AIMessage.id` is LangChain's own run id (`lc_run--<run_id>`), assigned before
  binding, so the span that holds the answer is owned by an id the callback handler
  can also compute from the run.

Which session a call uses is decided in `agentkv_langchain.sessions`.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Generator, Iterator, Mapping, Sequence
from contextlib import closing
from typing import Any, Literal, Self

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LanguageModelInput
from langchain_core.language_models.chat_models import BaseChatModel, LangSmithParams
from langchain_core.language_models.model_profile import ModelProfile
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import ConfigDict, Field, PrivateAttr, model_validator

from agentkv import AgentKVConfig, AnySession, Backend, EngineBackend, Session, TransformersBackend
from agentkv.chat import normalize_messages
from agentkv_langchain.backends import resolve_config, session_settings, shared_backend
from agentkv_langchain.calls import (
    CallAnswer,
    answer_filter,
    answer_message_id,
    call_metadata,
    call_usage,
    close_iterator,
    finish_reason,
    langchain_way_out,
    loaded_model_name,
    read_answer,
    run_id_of,
    tool_call_ban,
    unparseable,
)
from agentkv_langchain.constrained import StructuredOutput, check_tool_schemas, grammar_processor
from agentkv_langchain.messages import to_chat_dicts
from agentkv_langchain.planning import CallPlanning
from agentkv_langchain.sessions import calling, session_for
from agentkv_langchain.tools import (
    ANY_TOOL,
    TOOL_CALL_OPEN,
    CallEnd,
    choose_tool,
    forced_call_prefix,
    resolve_tool_choice,
    tool_names,
    tool_parameters,
)

__all__ = ["ChatAgentKV", "to_chat_dicts"]


class ChatAgentKV(StructuredOutput, CallPlanning, BaseChatModel):
    """A local Transformers model whose KV cache lives across an agent's calls.

    Setup:
        ```python
        from agentkv_langchain import ChatAgentKV

        llm = ChatAgentKV()  # the default model (SmolLM2-135M-Instruct), loaded once per process
        llm = ChatAgentKV(model="HuggingFaceTB/SmolLM2-360M-Instruct", config="graph.yaml")
        ```
        Without `backend=`, the model runs on the process-wide backend
        (`agentkv_langchain.backends.shared_backend`) that `with_kv_lifecycle(graph)`
        uses too, so the model calls and the lifecycle events meet in one session
        table. Pass `backend=TransformersBackend(model, tokenizer)` to manage it yourself.

    Sessions: inside a LangGraph graph each `thread_id` gets its own session (KV
    cache); outside one, pass `config={"metadata": {"thread_id": "..."}}`, or fix one
    with `session_id=`. Calls without either share the session "default".

    Usage: `usage_metadata["input_tokens"]` counts the tokens the answer's first token
    attended (its prompt as the cache holds it: an evicted or archived span is not in
    it), and `["input_token_details"]["cache_read"]` the ones of those read from the
    cache; `response_metadata["prefill_tokens"]` the ones the call encoded (new
    messages, the previous answer's end, spans recomputed from their tokens), so
    `input_tokens = cache_read + prefill_tokens` exactly (on an `EngineBackend`, the
    engine's own figures: `input_tokens` is the prompt it was sent, `cache_read` the
    part it reused, `prompt_tokens_details.cached_tokens`). `response_metadata` also
    has `rehydrated_tokens` (of those, recomputed spans), `reused_tokens`,
    `session_id` and `time_to_first_token_s` (seconds from the call's start to its
    first decoded text, tool-call text that is not streamed included; None when the
    model ended at once).

    Tool calling: `bind_tools` accepts anything `convert_to_openai_tool` does; calls are
    written in the model family's own format (docs/tool-formats.md) and, with `grammar` on
    (the default), constrained to their tools' schemas (`agentkv.grammar`): even a tiny
    model's calls parse. A reasoning block goes to `additional_kwargs["reasoning_content"]`.
    """

    backend: Backend
    """The in-process model (or a served engine) and its sessions (one KV cache per conversation);
    default: `shared_backend(config, model=model)`."""
    model: str | None = Field(default=None, exclude=True)
    """Model id / directory / .gguf path to load when no `backend` is given (None = `config.model`)."""
    config: Any = Field(default=None, exclude=True)
    """agentkv settings when no `backend` is given: `AgentKVConfig`, YAML-shaped mapping or YAML path."""
    session_id: str | None = None
    """A fixed session for every call; None = per call, from the run metadata's `thread_id`."""
    tool_use: Literal["auto", "call_then_answer"] = "auto"
    """With tools bound and no `tool_choice`: "auto" lets the model decide; "call_then_answer"
    forces a call on a user turn and a text answer after a tool result; a call the thread already
    holds the result of is answered from it instead (`planning.call_then_answer_choice`)."""
    tool_format: str | None = None
    """Tool-call format (docs/tool-formats.md); None: the backend's. Set, it becomes the backend's."""
    grammar: bool = True
    """Constrain tool calls and structured output with a grammar (`agentkv.grammar`); False: calls
    are only prefilled with their opening (as on engine sessions). See docs/integrations.md."""
    max_new_tokens: int = Field(default=256, alias="max_tokens")
    """At most this many generated tokens per answer (`max_tokens=` sets it too)."""
    temperature: float = 0.0
    """0 = greedy decoding (reproducible); above 0, sampling with `top_p` / `top_k`."""
    top_p: float = 1.0
    """Nucleus sampling threshold (used only when `temperature > 0`)."""
    top_k: int = 0
    """Keep only the k most likely tokens when sampling (0 = off)."""
    stop: list[str] | None = None
    """Strings that end an answer (excluded from it); a call's own `stop` replaces these."""
    seed: int | None = None
    """Seeds the sampler, for reproducible sampled answers."""
    model_name: str | None = None
    """Name reported in traces and `response_metadata`; default: the model's id, or its GGUF's name."""

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    _session_config: AgentKVConfig | None = PrivateAttr(default=None)
    """Settings of the sessions this model creates when `config=` differs from the shared backend's."""

    @model_validator(mode="before")
    @classmethod
    def _default_backend(cls, data: Any) -> Any:
        """No `backend`: the process-wide one for `model` / `config` (the one `with_kv_lifecycle` uses)."""
        if not isinstance(data, Mapping) or data.get("backend") is not None:
            if isinstance(data, Mapping) and (
                data.get("model") is not None or data.get("config") is not None
            ):
                msg = (
                    "ChatAgentKV: give either backend= (a loaded model) or model= / config= "
                    "(to load one on the shared backend), not both"
                )
                raise ValueError(msg)
            return data
        return {**data, "backend": shared_backend(data.get("config"), model=data.get("model"))}

    @model_validator(mode="after")
    def _own_session_settings(self) -> Self:
        """`config=` on the shared backend applies to this model's sessions; `tool_format=`, backend-wide."""
        if self.config is not None:
            wanted = resolve_config(self.config, model=self.model)
            self._session_config = session_settings(wanted, self.backend.config)
        if self.tool_format is not None and self.tool_format != self.backend.chat_format.tool_format.name:
            self.backend.chat_format.use_tool_format(self.tool_format)
        return self

    @model_validator(mode="after")
    def _default_model_name(self) -> Self:
        if not self.model_name:
            backend = self.backend
            if isinstance(backend, EngineBackend):
                self.model_name = backend.engine.served_model
            elif isinstance(backend, TransformersBackend):
                self.model_name = loaded_model_name(backend.model)
        return self

    # -- LangChain plumbing ------------------------------------------------------------------

    @property
    def _llm_type(self) -> str:
        return "agentkv"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "session_id": self.session_id,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop,
            "seed": self.seed,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="agentkv",
            ls_model_name=str(kwargs.get("model") or self.model_name),
            ls_model_type="chat",
            ls_temperature=float(kwargs.get("temperature", self.temperature)),
            ls_max_tokens=int(kwargs.get("max_tokens", kwargs.get("max_new_tokens", self.max_new_tokens))),
        )
        if stop or self.stop:
            params["ls_stop"] = list(stop or self.stop or [])
        return params

    def _resolve_model_profile(self) -> ModelProfile | None:
        profile = ModelProfile(
            open_weights=True,
            text_inputs=True,
            image_inputs=False,
            audio_inputs=False,
            pdf_inputs=False,
            video_inputs=False,
            text_outputs=True,
            tool_calling=True,
            tool_choice=True,
            tool_call_streaming=False,
        )
        limit = self.backend.max_positions
        if limit:
            profile["max_input_tokens"] = int(limit)
        return profile

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of `text` with the model's own tokenizer (used by `get_num_tokens`)."""
        return self.backend.chat_format.encode(text)

    def get_num_tokens_from_messages(
        self,
        messages: list[BaseMessage],
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool] | None = None,
    ) -> int:
        """Exact prompt length: the messages (and tool prompt) as the chat template renders them.

        Trimming and summarisation middleware count with this, so it must count what
        the session will encode, not an approximation.
        """
        chat = to_chat_dicts(messages)
        if tools:
            chat = self._with_tools(chat, [convert_to_openai_tool(t) for t in tools])
        fmt = self.backend.chat_format
        return len(fmt.encode(fmt.render(normalize_messages(chat))))

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: dict[str, Any] | str | bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (anything `convert_to_openai_tool` accepts) for the model to call.

        Args:
            tools: the tools, in the order they are described to the model.
            tool_choice: None / "auto": the model decides; "none": no call (the
                `<tool_call>` tag cannot be written, so the model answers in text);
                "any" / "required" / True: a call is forced, the model picks the tool
                under the grammar (`grammar=False`: names scored by `tools.choose_tool`);
                a tool name, or a dict naming a function: a call to that tool is forced.
            **kwargs: passed on to `bind` (e.g. `ls_structured_output_format`).

        Raises:
            ValueError: a tool cannot be converted, `tool_choice` names no bound tool, or a tool's
                parameters cannot be expressed as a grammar (`GrammarError`, naming the tool).
        """
        formatted: list[dict[str, Any]] = []
        for i, tool in enumerate(tools):
            try:
                formatted.append(convert_to_openai_tool(tool))
            except (TypeError, ValueError, KeyError) as e:
                msg = (
                    f"bind_tools: tools[{i}] ({tool!r:.80}): not a tool, function, schema or OpenAI dict: {e}"
                )
                raise ValueError(msg) from e
        resolve_tool_choice(tool_choice, tool_names(formatted))  # fail at bind time, not at the first call
        if self.grammar:
            check_tool_schemas(formatted)
        if tool_choice is not None:
            kwargs["tool_choice"] = tool_choice
        return super().bind(tools=formatted, **kwargs)

    # -- entry points: the call's config picks its session (see `agentkv_langchain.sessions`) -----

    def invoke(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> AIMessage:
        """`BaseChatModel.invoke`, with the config's thread kept for the session choice."""
        with calling(config):
            return super().invoke(input, config, stop=stop, **kwargs)

    async def ainvoke(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> AIMessage:
        """`BaseChatModel.ainvoke`, with the config's thread kept for the session choice."""
        with calling(config):
            return await super().ainvoke(input, config, stop=stop, **kwargs)

    def stream(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> Iterator[AIMessageChunk]:
        """`BaseChatModel.stream`, with the config's thread kept while the session is picked.

        langchain-core calls `_stream` without a run manager, and the session is picked
        while the first chunk is made, so the config is held for that step.
        """
        chunks = super().stream(input, config, stop=stop, **kwargs)
        with calling(config):
            first = next(chunks, None)
        if first is None:
            return
        yield first
        yield from chunks

    async def astream(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[AIMessageChunk]:
        """`BaseChatModel.astream`, with the session picked as in `stream`."""
        chunks = super().astream(input, config, stop=stop, **kwargs)
        with calling(config):
            first = await anext(chunks, None)
        if first is None:
            return
        yield first
        async for chunk in chunks:
            yield chunk

    # -- generation -----------------------------------------------------------------------------

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        message_id = answer_message_id(run_id_of(run_manager))
        with closing(self._answer(messages, stop, call_metadata(run_manager), message_id, kwargs)) as answer:
            final = next(item for item in answer if isinstance(item, CallAnswer))
        message = AIMessage(
            content=final.content,
            additional_kwargs=final.additional_kwargs,
            id=final.message_id,
            tool_calls=final.tool_calls,
            invalid_tool_calls=final.invalid_tool_calls,
            usage_metadata=final.usage,
            response_metadata=final.response_metadata,
        )
        return ChatResult(
            generations=[ChatGeneration(message=message, generation_info=final.generation_info)]
        )

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        with closing(
            self._chunks(messages, stop, call_metadata(run_manager), run_id_of(run_manager), kwargs)
        ) as chunks:
            for chunk in chunks:
                if run_manager:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        # The model runs on a worker thread; the session lock serialises calls on one session.
        sync_manager = run_manager.get_sync() if run_manager else None
        return await asyncio.to_thread(self._generate, messages, stop, sync_manager, **kwargs)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        # The whole generation runs on ONE worker thread: the session lock is held
        # across the decode loop and must be released by the thread that took it
        # (LangChain's default `_astream` would step the iterator from pool threads).
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[ChatGenerationChunk | BaseException | None] = asyncio.Queue()
        stopped = threading.Event()
        chunks = self._chunks(messages, stop, call_metadata(run_manager), run_id_of(run_manager), kwargs)

        def produce() -> None:
            try:
                with closing(chunks):
                    for chunk in chunks:
                        loop.call_soon_threadsafe(queue.put_nowait, chunk)
                        if stopped.is_set():
                            break
            except BaseException as e:  # handed to the consumer, which re-raises it
                loop.call_soon_threadsafe(queue.put_nowait, e)
            else:
                loop.call_soon_threadsafe(queue.put_nowait, None)

        worker = asyncio.ensure_future(asyncio.to_thread(produce))
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                if run_manager:
                    await run_manager.on_llm_new_token(item.text, chunk=item)
                yield item
        finally:
            stopped.set()
            await worker

    def _chunks(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        metadata: Mapping[str, Any],
        run_id: uuid.UUID | None,
        kwargs: Mapping[str, Any],
    ) -> Generator[ChatGenerationChunk, None, None]:
        """The answer as stream chunks: content as it is decoded; the last carries calls and usage."""
        message_id = answer_message_id(run_id)
        with closing(self._answer(messages, stop, metadata, message_id, kwargs)) as answer:
            for item in answer:
                if isinstance(item, str):
                    yield ChatGenerationChunk(message=AIMessageChunk(content=item, id=message_id))
                    continue
                calls = [
                    tool_call_chunk(name=c["name"], args=json.dumps(c["args"]), id=c["id"], index=i)
                    for i, c in enumerate(item.tool_calls)
                ]
                calls += [
                    tool_call_chunk(
                        name=c["name"], args=unparseable(c["args"]), id=c["id"], index=len(calls) + i
                    )
                    for i, c in enumerate(item.invalid_tool_calls)
                ]
                yield ChatGenerationChunk(
                    message=AIMessageChunk(
                        content=item.rest,
                        additional_kwargs=item.additional_kwargs,
                        id=item.message_id,
                        tool_call_chunks=calls,
                        chunk_position="last",
                        usage_metadata=item.usage,
                        response_metadata=item.response_metadata,
                    ),
                    generation_info=item.generation_info,
                )

    def _answer(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        metadata: Mapping[str, Any],
        message_id: str,
        kwargs: Mapping[str, Any],
    ) -> Generator[str | CallAnswer, None, None]:
        """Extend the session, decode, bind the answer; yield content text, then the `CallAnswer`."""
        started = time.perf_counter()
        session = self._session(metadata)
        plan = self._plan(messages, stop, kwargs, session)
        fmt = self.backend.chat_format.tool_format
        raw: list[str] = []
        first_token_s: float | None = None
        with session.lock:  # extend + decode + bind are one step for this session
            before = session.stats()
            # One forward per call: the new messages are encoded with the generation prompt.
            with langchain_way_out():
                extended = session.extend(plan.messages, prefill=False)
            prefix, local = plan.prefix, isinstance(session, Session)
            if plan.choice == ANY_TOOL and plan.grammar is None:  # unconstrained "any": names scored
                names = tool_names(plan.tools)
                name = names[0]  # an engine session cannot score the names: the first bound tool
                if isinstance(session, Session):
                    name = choose_tool(session.answer_logprob, names, fmt)
                prefix = forced_call_prefix(name, tool_parameters(plan.tools, name), fmt)
            visible = answer_filter(self.backend.chat_format, plan.tools)
            if visible is not None:
                visible.feed(prefix)
            call_end = CallEnd(prefix, fmt) if prefix and not plan.parallel else None
            options: dict[str, Any] = {**plan.sampling, "prefix": prefix, "message_id": message_id}
            if plan.grammar is not None and local:
                limit, closes = plan.sampling["max_new_tokens"], call_end is not None
                options["logits_processor"] = grammar_processor(
                    self.backend, plan.grammar, prefix, limit, ends_at_call_close=closes
                )
            elif plan.ban_calls and local:
                options["logits_processor"] = tool_call_ban(self.backend)
            elif plan.ban_calls:  # the engine has no decode hook: the answer ends at the tag instead
                options["stop"] = [*options["stop"], fmt.trigger or TOOL_CALL_OPEN]
            pieces = session.stream(**options)
            try:
                for piece in pieces:
                    if first_token_s is None:
                        first_token_s = time.perf_counter() - started
                    raw.append(piece)
                    text = visible.feed(piece) if visible is not None else piece
                    if text:
                        yield text
                    if call_end is not None and call_end.feed(piece):
                        break  # the forced call is complete; what follows would be noise
            finally:
                close_iterator(pieces)  # an abandoned stream still ends the answer (and frees the lock) here
            after = session.stats()
            read = read_answer(prefix + "".join(raw), plan.tools, visible, self.backend.chat_format)
            # The caller gets exactly this message back; binding it lets the next call
            # match it to the produced token ids instead of re-encoding it.
            session.bind_message(read.as_message(message_id))
            output_tokens = after.generated_tokens - before.generated_tokens
            input_tokens, cache_read, new_tokens = call_usage(session, before, after)
        # A forced call the thread already holds the result of: answer from that result.
        if self._answered_already(messages, kwargs, read.tool_calls):
            yield from self._answer(messages, stop, metadata, message_id, {**kwargs, "tool_choice": "none"})
            return
        limit, processor = plan.sampling["max_new_tokens"], options.get("logits_processor")
        finish = finish_reason(read, output_tokens, limit, processor, self.backend.tokenizer)
        yield CallAnswer(
            message_id=message_id,
            content=read.content,
            rest=read.rest,
            tool_calls=read.tool_calls,
            invalid_tool_calls=read.invalid_tool_calls,
            usage=UsageMetadata(
                input_tokens=input_tokens,
                output_tokens=output_tokens,
                total_tokens=input_tokens + output_tokens,
                input_token_details={"cache_read": cache_read},
            ),
            response_metadata={
                "model_name": self.model_name,
                "finish_reason": finish,
                "session_id": session.session_id,
                "prefill_tokens": new_tokens,
                "rehydrated_tokens": after.rehydrated_tokens - before.rehydrated_tokens,
                "reused_tokens": extended.reused_tokens if local else cache_read,
                "cropped_tokens": extended.cropped_tokens,
                "time_to_first_token_s": first_token_s,
            },
            generation_info={"finish_reason": finish},
            reasoning=read.reasoning,
        )

    def _session(self, metadata: Mapping[str, Any]) -> AnySession:
        """The session this call extends: the thread's (or `session_id`'s), see `agentkv_langchain.sessions`.

        The one place a call picks its KV cache; a subclass that wants another cache per
        call (a stateless baseline that re-encodes everything) overrides only this.
        """
        return session_for(self.backend, metadata, self.session_id, self._session_config)
