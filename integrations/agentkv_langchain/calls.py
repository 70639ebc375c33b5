"""What one `ChatAgentKV` call carries and the small helpers around it.

`CallPlan` (what a call hands the session) and `CallAnswer` (one finished answer),
the call's metadata, run and message ids, the model's display name, the
per-tokenizer `ToolCallBan`, and the way out a too-long thread is told
(`langchain_way_out`). Nothing here holds a session or a model.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.messages import InvalidToolCall, ToolCall
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import invalid_tool_call
from langchain_core.utils.json import parse_partial_json
from langchain_core.utils.utils import LC_ID_PREFIX

from agentkv import AnySession, Backend, ContextLengthError, Session, SessionStats
from agentkv.grammar import GrammarProcessor
from agentkv.models import MANIFEST_NAME
from agentkv.templates import ChatFormat
from agentkv_langchain.sessions import current_metadata
from agentkv_langchain.tools import (
    ToolCallBan,
    ToolCallStreamFilter,
    banned_opening,
    parse_tool_calls,
    split_answer,
    tool_names,
)
from agentkv_langchain.toolset import outside

__all__ = [
    "CallAnswer",
    "ReadAnswer",
    "answer_filter",
    "CallPlan",
    "answer_message_id",
    "call_metadata",
    "call_usage",
    "close_iterator",
    "finish_reason",
    "loaded_model_name",
    "run_id_of",
    "tool_call_ban",
    "unparseable",
]

logger = logging.getLogger("agentkv.langchain")


@dataclass
class CallAnswer:
    """One finished answer, already bound to its session."""

    message_id: str
    content: str
    rest: str
    """The part of `content` a stream had not shown yet (held back around tool calls)."""
    tool_calls: list[ToolCall]
    invalid_tool_calls: list[InvalidToolCall]
    usage: UsageMetadata
    response_metadata: dict[str, Any]
    generation_info: dict[str, Any]
    reasoning: str | None = None
    """The answer's reasoning block (`additional_kwargs["reasoning_content"]`), never content or calls."""

    @property
    def additional_kwargs(self) -> dict[str, Any]:
        """The message's `additional_kwargs`: its reasoning, when it has one."""
        return {"reasoning_content": self.reasoning} if self.reasoning else {}


@dataclass
class CallPlan:
    """What one call hands the session."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    prefix: str
    """Text the answer starts with (a forced call's opening), prefilled, not generated."""
    sampling: dict[str, Any] = field(default_factory=dict)
    choice: str | None = None
    """The resolved `tool_choice`: a tool name, `ANY_TOOL`, "none" or None."""
    ban_calls: bool = False
    """Keep the answer from writing a `<tool_call>` tag (it answers in text instead)."""
    grammar: str | None = None
    """The grammar the answer is decoded under (`agentkv.grammar`); None = unconstrained."""
    parallel: bool = False
    """Several calls may be made in one answer (`parallel_tool_calls=True`)."""


# ---------------------------------------------------------------------------- small helpers


def call_metadata(
    run_manager: CallbackManagerForLLMRun | AsyncCallbackManagerForLLMRun | None,
) -> Mapping[str, Any]:
    """The call's metadata: the run manager's, completed with the call's config (`current_metadata`)."""
    return current_metadata(run_manager.metadata if run_manager is not None else None)


def loaded_model_name(model: Any) -> str:
    """A readable name for a loaded model: its hub id or directory name.

    `load_model()` serves a GGUF from a converted copy named by the file's hash; the
    copy's manifest (written by `agentkv.models`) names the GGUF, whose stem is used.
    """
    path = str(getattr(getattr(model, "config", None), "name_or_path", "") or "")
    manifest = Path(path, MANIFEST_NAME) if path else None
    if manifest is not None and manifest.is_file():
        try:
            source = json.loads(manifest.read_text()).get("source")
        except (OSError, ValueError):
            source = None
        if isinstance(source, str) and source:
            return Path(source).name.removesuffix(".gguf")
    if path:
        return path if not Path(path).is_dir() else Path(path).name
    return type(model).__name__


def answer_message_id(run_id: uuid.UUID | None) -> str:
    """The answer's id: LangChain's own `lc_run--<run_id>`, so the callback handler can name the span."""
    return f"{LC_ID_PREFIX}-{run_id or uuid.uuid4()}"


def run_id_of(
    run_manager: CallbackManagerForLLMRun | AsyncCallbackManagerForLLMRun | None,
) -> uuid.UUID | None:
    """The call's run id, if LangChain gave it a run manager."""
    return run_manager.run_id if run_manager is not None else None


def call_usage(session: AnySession, before: SessionStats, after: SessionStats) -> tuple[int, int, int]:
    """`(input_tokens, cache_read, new_tokens)` of the call that ran between `before` and `after`.

    A local session says what the answer's first token attended (`Session.last_prompt`):
    `input_tokens` = those tokens, `cache_read` = the ones the call did not encode itself,
    `new_tokens` = the ones it did (new messages, the previous answer's pending end, spans
    recomputed from their tokens), so `input_tokens = cache_read + new_tokens` exactly and
    no token the model did not attend is counted as read. An engine session reports the
    engine's own figures: the part of the prompt it reused and the part it encoded.
    """
    prompt = session.last_prompt if isinstance(session, Session) else None
    if prompt is None:
        cache_read = after.reused_tokens - before.reused_tokens
        new_tokens = after.prefill_tokens - before.prefill_tokens
        return new_tokens + cache_read, cache_read, new_tokens
    return prompt.usage(before.encoded_tokens)


def answer_filter(chat_format: ChatFormat, tools: Sequence[Mapping[str, Any]]) -> ToolCallStreamFilter | None:
    """What decides which streamed text is content: held back at calls (tools bound) and reasoning."""
    if not tools and chat_format.reasoning is None:
        return None
    return ToolCallStreamFilter(chat_format.tool_format if tools else None, chat_format.reasoning)


@dataclass
class ReadAnswer:
    """An answer's whole text, read: its content, calls and reasoning."""

    content: str
    tool_calls: list[ToolCall]
    invalid_tool_calls: list[InvalidToolCall]
    rest: str
    """The part of `content` a stream had not shown yet."""
    reasoning: str | None

    def as_message(self, message_id: str) -> dict[str, Any]:
        """The assistant message the caller gets back, as the session binds it to the answer."""
        return {
            "role": "assistant",
            "content": self.content,
            "tool_calls": [{"id": c["id"], "name": c["name"], "args": c["args"]} for c in self.tool_calls],
            "id": message_id,
            **({"reasoning_content": self.reasoning} if self.reasoning else {}),
        }


def read_answer(
    text: str,
    tools: Sequence[Mapping[str, Any]],
    visible: ToolCallStreamFilter | None,
    chat_format: ChatFormat | None = None,
) -> ReadAnswer:
    """An answer's whole text as content, calls, the part a stream has not shown, and reasoning.

    A reasoning block (`<think>…</think>` in a family that thinks) is split off first: it
    is never content and never read for calls. Without tools bound the rest is the
    content; with tools, calls are read in the backend's tool format, and calls to a tool
    that is listed in the prompt but not bound to this call become invalid calls that say
    so.
    """
    reasoning, answer = split_answer(text, chat_format.reasoning if chat_format is not None else None)
    if not tools:
        return ReadAnswer(answer, [], [], visible.rest(answer) if visible is not None else "", reasoning)
    fmt = chat_format.tool_format if chat_format is not None else None
    content, calls, invalid = parse_tool_calls(answer, fmt) if fmt is not None else parse_tool_calls(answer)
    rest = visible.rest(content) if visible is not None else ""
    bound = ", ".join(tool_names(tools))
    for i in reversed(outside(calls, tools)):
        call = calls.pop(i)
        invalid.insert(
            0,
            invalid_tool_call(
                name=call["name"],
                args=json.dumps(call["args"]),
                id=call["id"],
                error=f"tool {call['name']!r} is not bound to this call; bound: {bound}",
            ),
        )
    return ReadAnswer(content, calls, invalid, rest, reasoning)


def finish_reason(read: ReadAnswer, output_tokens: int, limit: int, processor: Any, tokenizer: Any) -> str:
    """The answer's `finish_reason`; an answer that `max_new_tokens` cut or ended early is logged.

    "tool_calls" when it made calls, else "length" when the budget ended it: it ran to
    `limit` tokens, or the grammar's `processor` kept the model from a token to stay inside
    it (a call's opening with too few tokens left). A call cut in the middle (grammar off)
    stays an invalid call whose error says it was cut, so the user knows to raise the limit.
    """
    cut = processor.cut if isinstance(processor, GrammarProcessor) else None
    if cut is not None:
        logger.warning("%s", cut.message(limit, tokenizer.decode([cut.token])))
    if output_tokens >= limit and read.invalid_tool_calls:
        last = read.invalid_tool_calls[-1]
        last["error"] = (
            f"cut at max_new_tokens={limit} before the call was complete ({last.get('error')}); "
            "raise max_new_tokens"
        )
        logger.warning(
            "max_new_tokens=%d cut the tool call %r in the middle; raise max_new_tokens",
            limit,
            last.get("name"),
        )
    if read.tool_calls:
        return "tool_calls"
    return "length" if output_tokens >= limit or cut is not None else "stop"


_BANS: dict[tuple[int, str], ToolCallBan] = {}
_BANS_LOCK = threading.Lock()


def tool_call_ban(backend: Backend) -> ToolCallBan:
    """The backend tokenizer's `ToolCallBan` for its tool format (built once: it reads every token's text)."""
    banned = banned_opening(backend.chat_format.tool_format)
    key = (id(backend.tokenizer), banned)
    with _BANS_LOCK:
        ban = _BANS.get(key)
        if ban is None or ban.tokenizer is not backend.tokenizer:
            ban = _BANS[key] = ToolCallBan(backend.tokenizer, banned)
        return ban


def close_iterator(iterator: Iterator[Any]) -> None:
    """Close a generator (or anything with `close`); other iterators are left as they are."""
    close = getattr(iterator, "close", None)
    if close is not None:
        close()


def unparseable(args: str | None) -> str:
    """An invalid call's raw text, in a form that chunk merging will not "repair" into a valid call.

    Merged stream chunks re-parse their `args` leniently (`parse_partial_json`); raw text
    that happens to parse that way is sent as a JSON string literal instead.
    """
    raw = args or ""
    try:
        repaired = parse_partial_json(raw)
    except (ValueError, TypeError):
        return raw
    return json.dumps(raw) if isinstance(repaired, dict) else raw


CONTEXT_WAY_OUT = (
    "keep the thread's history under it: LangChain's SummarizationMiddleware (create_agent(..., "
    'middleware=[SummarizationMiddleware(model, trigger=("tokens", N))])) replaces old turns with a '
    "summary, or trim_messages(messages, max_tokens=N, token_counter=llm) drops them; the session "
    "keeps the unchanged start and encodes only what changed"
)
"""What `ContextLengthError` tells a LangChain user to do (N: under the model's positions)."""


@contextmanager
def langchain_way_out() -> Iterator[None]:
    """Re-raise a session's `ContextLengthError` naming LangChain's way out (`CONTEXT_WAY_OUT`)."""
    try:
        yield
    except ContextLengthError as e:
        raise ContextLengthError(e.session_id, e.total, e.limit, CONTEXT_WAY_OUT) from e
