"""The lifecycle verbs every session has, whatever runs it: pin, release, bind, fork, the answer's close.

`Session` (a local model over a `KVStore`) and `EngineSession` (a served engine over an
`EngineStore`) differ in how they encode and decode; what they do with the span table
and the lifecycle manager around that is this class, so a fix to it is made once.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Self

from agentkv.backend.contracts import BackendHost, SessionClosedError
from agentkv.backend.readout import SessionReadout
from agentkv.chat import ChatMessage, message_fingerprint, normalize_messages
from agentkv.config import AgentKVConfig
from agentkv.events import Event, validate_event
from agentkv.lifecycle.limits import BudgetLimits
from agentkv.lifecycle.results import ApplyResult
from agentkv.policies import Policy, SpanView
from agentkv.spans import Lease, Span, SpanKind
from agentkv.templates import Cached, ChatFormat

__all__ = ["SessionCore"]


class SessionCore(SessionReadout):
    """What both sessions do with their table and manager; the subclass encodes, decodes and closes."""

    config: AgentKVConfig
    format: ChatFormat
    branch: str | None
    closed: bool
    limits: BudgetLimits

    def __init__(
        self,
        backend: BackendHost,
        session_id: str,
        *,
        parent: Self | None = None,
        branch: str | None = None,
        config: AgentKVConfig | None = None,
    ) -> None:
        """The fields every session starts with, then the subclass's own (`_start`).

        A branch keeps its parent's settings (budget, rules).
        """
        self.parent = parent
        self.backend = backend
        self.session_id = session_id
        self.config = config or (parent.config if parent is not None else backend.config)
        self.format = backend.chat_format
        self.lock = threading.RLock()
        self.branch = branch
        self.closed = False
        self.limits = BudgetLimits.resolve(self.config.budget, backend.bytes_per_token)
        """The budget in bytes, resolved once; the manager enforces it (device and host alike)."""
        self._start(parent)

    def _start(self, parent: Self | None) -> None:
        """Build the session's table, store and manager (a branch's from its parent's)."""
        raise NotImplementedError

    def _check_open(self) -> None:
        if self.closed:
            msg = (
                f"session {self.session_id!r} is closed; backend.session({self.session_id!r}) makes a new one"
            )
            raise SessionClosedError(msg)

    def _match(self, messages: Sequence[Any]) -> tuple[list[ChatMessage], list[Span], int, list[str]]:
        """`(messages normalised, message spans, how many leading messages are held, texts after those)`.

        Messages are matched by fingerprint, then by text: a matched message whose rendering
        changed (a template that drops older reasoning, or renders a turn differently once
        another follows) is not held any more, and neither is anything after it, so the
        cache always holds exactly what the template renders. Call with the lock held.

        Raises:
            SessionClosedError: the session is closed.
        """
        incoming = normalize_messages(messages)
        self._check_open()
        message_spans = self.table.message_spans()
        k = 0
        while (
            k < len(message_spans)
            and k < len(incoming)
            and incoming[k].fingerprint() in message_spans[k].fingerprints
        ):
            k += 1
        split = self.format.split(
            incoming, [Cached(span.text, span.produced_text) for span in message_spans[:k]]
        )
        for index, text in split.learned.items():
            message_spans[index].text = text  # the template's text from now on
        for span in message_spans[: split.kept]:
            span.produced_text = False
        return incoming, message_spans, split.kept, split.texts

    def _count_turn(self, message: ChatMessage) -> None:
        """A user message opens a turn: the manager hears of it, then the table's turn moves on."""
        if message.role == "user":
            self.manager.on_new_user_turn()
            self.table.turn += 1

    def _check_answer(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Raise when this session cannot answer now (the subclass adds its own limits)."""
        del prompt_tokens, max_new_tokens

    def _open_answer(self, prefix: str, message_id: str | None, max_new_tokens: int) -> tuple[Span, int]:
        """The assistant span an answer is decoded into, holding its prompt; `(span, prompt length)`.

        Raises:
            SessionClosedError: the session is closed.
            ValueError: nothing to answer (no messages), or the subclass's `_check_answer` refuses.
        """
        self._check_open()
        if not self.messages:
            msg = f"session {self.session_id!r}: nothing to answer; call extend(messages) first"
            raise ValueError(msg)
        prompt = self.format.generation_prompt(self.messages) + prefix
        prompt_ids = self.format.encode(prompt)
        self._check_answer(len(prompt_ids), max_new_tokens)
        span = self._new_span(
            SpanKind.ASSISTANT, prompt_ids, generated=True, owner=message_id, text=prompt, produced_text=True
        )
        span.message_index = len(self.messages)
        self.manager.on_span_created(span)
        return span, len(prompt_ids)

    def _new_span(self, kind: SpanKind, token_ids: list[int], **fields: Any) -> Span:
        return self.table.new_span(kind, token_ids, branch=self.branch, **fields)

    def _describe_message(self, span: Span, message: ChatMessage, index: int) -> None:
        """Tie `span` to the message at `index` (kind, owner, fingerprint, tool call ids)."""
        span.kind = message.kind
        span.owner = message.owner
        span.message_index = index
        span.fingerprints = frozenset({message.fingerprint()})
        for call in message.tool_calls:
            self.manager.register_tool_call(call.id, span)

    def _finish_answer(self, span: Span, prefix: str, text: str, produced: int, *, computed: bool) -> None:
        """Close the assistant message the way the template would, so the next turn reuses it.

        `computed`: the end-of-turn ids are held already (the engine computes them on the
        next call with the rest of the prompt); False leaves them pending for the local model.
        """
        span.token_ids.extend(self.format.assistant_suffix_ids())
        span.text = (span.text or "") + text + self.format.assistant_suffix()
        if computed:
            span.n_computed = span.length
        message = ChatMessage("assistant", prefix + text, message_id=span.owner)
        span.fingerprints = frozenset({message.fingerprint(), message_fingerprint("assistant", text)})
        self.messages.append(message)
        self.counters.generated_tokens += produced
        self.table.record("generate", span=span.span_id, tokens=produced, chars=len(text))
        self.manager.after_operation()

    def bind_message(self, message: Any, span_id: int | None = None) -> None:
        """Say which message stands for a generated span (e.g. an AIMessage with parsed tool calls).

        The next `extend` then matches that message to the span's produced ids
        instead of re-encoding it.
        """
        normalized = normalize_messages([message])[0]
        with self.lock:
            generated = [s for s in self.spans if s.generated]
            if span_id is None and not generated:
                msg = "bind_message: this session has generated nothing yet"
                raise ValueError(msg)
            span = generated[-1] if span_id is None else self.table.span(span_id)
            span.fingerprints = span.fingerprints | {normalized.fingerprint()}
            if normalized.owner:
                span.owner = normalized.owner
            if normalized.tool_calls:
                span.kind = SpanKind.TOOL_CALL
                for call in normalized.tool_calls:
                    self.manager.register_tool_call(call.id, span)
            if 0 <= span.message_index < len(self.messages):
                self.messages[span.message_index] = normalized

    # -- the scorer ------------------------------------------------------------------------------

    @property
    def policy(self) -> Policy | None:
        """The session's token scorer (None for `full`); see docs/policies.md."""
        return self.manager.policy

    @policy.setter
    def policy(self, policy: Policy | None) -> None:
        """Replace the scorer; the session keeps its mode (whole spans or tokens)."""
        with self.lock:
            self.manager.policy = policy

    def scoring_view(self, span: Span | None = None) -> SpanView:
        """What the policy sees of `span`'s attended tokens (None: all); TypeError where the store cannot."""
        with self.lock:
            return self.manager.scoring_view(span)

    # -- lifecycle -------------------------------------------------------------------------------

    def apply(self, event: Event) -> ApplyResult:
        """Apply a lifecycle event (idempotent; unknown targets are logged no-ops).

        Raises:
            TypeError: `event` is not a well-formed event (`validate_event`; checked here, once).
        """
        validate_event(event)
        with self.lock:
            self._check_open()
            return self._apply_locked(event, enforce=True)

    def _apply_locked(self, event: Event, *, enforce: bool) -> ApplyResult:
        """Apply one event with the lock held (`enforce`: check the budget after it)."""
        return self.manager.apply(event, enforce=enforce)

    def pin(
        self, owner: str | None = None, *, span_ids: Sequence[int] | None = None, reason: str = ""
    ) -> Lease:
        """Pin spans (by owner or ids); returns the lease to give back with `release`."""
        with self.lock:
            lease = self.manager.pin(owner=owner, span_ids=span_ids, reason=reason)
            # Pinning brings back a span that was already demoted: the budget may need enforcing.
            self.manager.after_operation()
            return lease

    def release(self, lease: Lease) -> bool:
        """Give a pin back. Unknown or foreign leases change nothing (returns False)."""
        with self.lock:
            return bool(self.manager.release(lease))

    def fork(self, branch: str, *, config: AgentKVConfig | None = None) -> Self:
        """A branch session sharing this session's KV as a read-only prefix (no copy).

        `config` = the branch's own settings (None = this session's).
        """
        child: Self = self.backend.fork(self.session_id, branch, config=config)
        return child

    def close(self) -> None:
        """Free the session's KV (on the engine: unpin and delete it); its spans are forgotten."""
        with self.lock:
            self.store.close()
            self.table.clear()
            self.closed = True
