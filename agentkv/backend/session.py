"""A session: one conversation, one KV cache, one span table.

`extend(messages)` encodes only what the cache does not already hold: it matches
the incoming messages with the cached ones message by message (by fingerprint),
crops from the first that differs, and prefills the new suffix. `generate()` is
our own decode loop over a cache whose physical layout may differ from the
logical sequence. Lifecycle events, budgets and recall live in
`agentkv.lifecycle` (one `LifecycleManager` per session, held as
`session.manager`); this module only encodes and decodes. The session's state
(spans, messages, leases, turn, counters, log) is its public `SpanTable`,
which the lifecycle reads and writes through methods; the session offers the
lifecycle a few services (`SessionPort`: recompute a span, encode text, ...).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any, Unpack

import torch

from agentkv.backend.contracts import ContextLengthError, ExtendResult, SessionHost
from agentkv.backend.decoding import Answer, answer_logprob, decode_answer
from agentkv.backend.lifecycle_port import SessionServices
from agentkv.backend.prefix import start_from_shared_prefix
from agentkv.backend.runner import Feed
from agentkv.backend.sampling import AnswerOptions, SamplingParams
from agentkv.backend.session_core import SessionCore
from agentkv.chat import ChatMessage
from agentkv.events import Event, SessionClosed, TurnEnded, validate_event
from agentkv.forget import ForgetController, ForgetRequested
from agentkv.lifecycle.limits import BudgetLimits
from agentkv.lifecycle.manager import LifecycleManager
from agentkv.lifecycle.results import ApplyResult
from agentkv.lifecycle.table import SpanTable
from agentkv.metrics import PromptRead
from agentkv.spans import ATTENDED_STATES, Span, SpanState
from agentkv.store.kvstore import KVStore

logger = logging.getLogger("agentkv.backend.session")


class Session(SessionCore):
    """One conversation's KV cache. Thread-safe: a per-session lock serialises every call."""

    backend: SessionHost
    store: KVStore

    def _start(self, parent: Session | None) -> None:
        """The local model's runner and a `KVStore`; a branch forks its parent's cache."""
        self.runner = self.backend.runner
        self.store = KVStore(
            self.runner.num_layers, self.runner.device, self.config.quantization, window=self.runner.window
        )
        self.store.physical.context_source = self.context_ids
        self.table = SpanTable(self.session_id)
        """Spans, messages, leases, turn, counters and the event log (public)."""
        self.last_logits: torch.Tensor | None = None
        self.prefill_deferred = False
        """True after `extend(..., prefill=False)` until the next answer encodes the pending tokens."""
        self.last_prompt: PromptRead | None = None
        """What the latest answer's first token read (see `PromptRead`); None before any answer."""
        self.ended = False
        """True after `SessionClosed` until the next call brings the released history back (`_restart`)."""
        self.manager: LifecycleManager
        """Events, budgets and recall for this session (`agentkv.lifecycle`)."""
        self.forget = ForgetController(self)
        """The forgetting side thread and `forget_tool_outputs` requests (see `agentkv.forget`)."""
        if parent is not None:
            self._fork_from(parent)  # the branch's table, store and manager, under the parent's lock
        else:
            self.manager = LifecycleManager(SessionServices(self), self.limits)

    def _attended_tokens(self) -> tuple[int, int]:
        return self.store.physical.length, self.store.attended_quantized_tokens()

    def budget_limits(self) -> BudgetLimits:
        """This session's budget in bytes (device, host, global) with its watermarks."""
        return self.limits

    # -- small helpers -------------------------------------------------------------------------

    def span(self, span_id: int) -> Span:
        """The span with this id (KeyError naming the session when absent)."""
        return self.table.span(span_id)

    def spans_owned_by(self, owner: str) -> list[Span]:
        """Spans whose owner (message id, tool_call_id, branch) is `owner`."""
        return self.table.owned_by(owner)

    def token_ids(self) -> list[int]:
        """The whole logical sequence's token ids (nothing is ever lost)."""
        return self.table.token_ids()

    def context_ids(self, length: int) -> list[int]:
        """The token ids of logical positions `0 .. length - 1` (sliding KV recomputed from them)."""
        return self.table.token_ids()[:length]

    # -- encoding ------------------------------------------------------------------------------

    def extend(
        self, messages: Sequence[Any], *, prefill: bool = True, events: Sequence[Event] = ()
    ) -> ExtendResult:
        """Bring the cache in line with `messages`, encoding only what it does not hold.

        Messages are matched with the cached ones by fingerprint (role, content, tool
        calls, tool_call_id); from the first that differs the cache is cropped and the
        rest encoded. Inside that first changed message, tokens equal to the cached
        ones are kept, so a rewritten middle message re-encodes from its first
        changed token.

        Args:
            messages: The whole conversation so far (dicts or LangChain messages).
            prefill: False leaves the new messages' tokens pending: the next
                `generate` / `stream` encodes them together with its generation
                prompt in one forward. A model call is then one forward over the cache
                instead of two (the second, for a 3-token prompt, costs about as much
                as the first over a long cache); `ChatAgentKV` calls it this way. Any
                other call that needs the model (`continuation_logits`, the next
                `extend`) encodes pending tokens first.
            events: Lifecycle events that arrive with these messages (a user's "go with
                option B" and its `UserConfirmed`). They are applied once the new
                messages have spans and before recall and the budget plan for them, so
                the pressure the new messages add cannot demote what they confirm.
                Their results are `ExtendResult.applied`.
        """
        started = time.perf_counter()
        for event in events:  # before anything changes; the manager trusts them
            validate_event(event)
        with self.lock:
            incoming, message_spans, k, texts = self._match(messages)
            if any(m.role == "user" for m in incoming[k:]):
                # A turn boundary: forget decisions (side thread, agent requests) are applied now.
                self.forget.at_turn_boundary()
            new_ids = [self.format.encode(text) for text in texts]
            kept_end = message_spans[k].start if k < len(message_spans) else self.logical_length
            total = kept_end + sum(len(ids) for ids in new_ids)
            self._check_positions(total)

            cropped = 0
            partial = 0
            first_changed = k if k < len(message_spans) else None
            dropped: dict[tuple[str, str | None], list[Span]] = {}  # a message → its spans the crop drops
            if k < len(message_spans):
                old = message_spans[k]
                if new_ids and self._reusable_prefix(old):
                    partial = _common_prefix(old.token_ids[: old.n_computed], new_ids[0])
                first_dropped = self.spans.index(old) + (1 if partial else 0)
                for span in self.spans[first_dropped:]:
                    for fingerprint in span.fingerprints:
                        dropped.setdefault((fingerprint, span.owner), []).append(span)
                cropped = self._crop(old, keep_tokens=partial)
            new_spans: list[int] = []
            for offset, (message, ids) in enumerate(zip(incoming[k:], new_ids, strict=True)):
                index = k + offset
                self._count_turn(message)
                if offset == 0 and partial:
                    # The rewritten message keeps its unchanged leading tokens; it is new content.
                    span = self.spans[-1]
                    span.token_ids = list(ids)
                    self.manager.mover.reopen(span)  # after `_count_turn`, whose turn end commits it first
                    span.generated = False
                    span.turn = self.turn
                    # Forget what the old message registered (its tool call ids): they are not this one's.
                    self.manager.on_span_removed(span)
                    self._describe_message(span, message, index)
                else:
                    span = self._new_span(message.kind, ids)
                    self._describe_message(span, message, index)
                    self.manager.on_span_created(span)
                self._keep_standing(dropped, message, span)
                span.text, span.produced_text = texts[offset], False
                self.messages.append(message)
                new_spans.append(span.span_id)
            if self.ended:
                self._restart()  # the kept messages' released KV, pending with the new messages
            applied = tuple(self._apply_locked(event, enforce=False) for event in events)
            if any(m.role == "user" for m in incoming[k:]):
                self.manager.recall(incoming[-1])
            # A cache read: the kept messages' attended, computed tokens once recall has run (not a
            # pending tail, not a released span, not a span recomputed for this call: it is encoded).
            reused = partial + sum(_attended(s) for s in message_spans[:k])
            prefilled = self._prefill() if prefill else 0
            pending = 0 if prefill else len(Feed.pending(self.spans))
            self.prefill_deferred = pending > 0
            if self.prefill_deferred:
                self.last_logits = None  # the next answer computes them
            self.counters.reused_tokens += reused
            self.counters.cropped_tokens += cropped
            self.manager.after_operation()
            result = ExtendResult(
                prefilled_tokens=prefilled,
                reused_tokens=reused,
                cropped_tokens=cropped,
                new_spans=tuple(new_spans),
                first_changed_message=first_changed,
                seconds=time.perf_counter() - started,
                pending_tokens=pending,
                applied=applied,
            )
            self.table.record(
                "extend", prefilled=prefilled, reused=reused, cropped=cropped, spans=list(new_spans)
            )
            return result

    def _keep_standing(
        self, dropped: dict[tuple[str, str | None], list[Span]], message: ChatMessage, span: Span
    ) -> None:
        """`span` encodes a message the crop dropped a span of: it takes that span's state and pins.

        A history rewrite (a transient instruction left out of the next call) re-encodes
        the messages after it; a plan the user confirmed stays pinned, a rejected one released.
        """
        same = dropped.get((message.fingerprint(), message.owner))
        if not same:
            return
        earlier = same.pop(0)
        for spans in dropped.values():  # a span is listed under each of its fingerprints
            spans[:] = [s for s in spans if s is not earlier]
        self.manager.carry_over(earlier, span)

    def _check_answer(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """After `SessionClosed` the released history comes back first; the answer must fit the positions."""
        if self.ended:
            self._restart()
        # The answer is closed with the template's end-of-turn ids: they need positions too.
        suffix = len(self.format.assistant_suffix_ids())
        self._check_positions(self.logical_length + prompt_tokens + max_new_tokens + suffix)

    def _restart(self) -> None:
        """The conversation goes on after `SessionClosed`: bring back every span it released.

        A released span keeps its token ids: it is recomputed from them at its logical
        positions, in the next prefill with the call's new tokens, exactly as a session
        never closed holds it. An answer never reads a history the model does not attend.
        """
        self.ended = False
        for span in self.spans:
            if span.state in (SpanState.ARCHIVED, SpanState.EVICTED):
                self.manager.mover.move(span, SpanState.COMMITTED, reason="session_restarted", lazily=True)

    def _check_positions(self, total: int) -> None:
        limit = self.runner.max_positions
        if limit is not None and total > limit:
            raise ContextLengthError(self.session_id, total, limit)

    def _reusable_prefix(self, span: Span) -> bool:
        """Whether a span's leading tokens can stay when its message is rewritten."""
        return span.tier.attended and span.kept is None and span.state is not SpanState.EVICTED

    def _crop(self, first: Span, *, keep_tokens: int = 0) -> int:
        """Drop `first` (except its first `keep_tokens`) and every span after it."""
        with self.store.physical.deferred_removal():  # one compaction, however many spans go
            index = self.spans.index(first)
            dropped = 0
            for span in self.spans[index + 1 :]:
                dropped += span.length
                self.store.forget(span)
                self.manager.on_span_removed(span)
            self.table.truncate(index + 1)
            self.table.truncate_messages(
                first.message_index if first.message_index >= 0 else len(self.messages)
            )
            if keep_tokens:
                self.manager.mover.cut(first, keep_tokens)
                dropped += first.length - keep_tokens
                first.token_ids = first.token_ids[:keep_tokens]
                first.n_computed = keep_tokens
                first.fingerprints = frozenset()
            else:
                dropped += first.length
                self.store.forget(first)
                self.manager.on_span_removed(first)
                self.table.truncate(index)
            if self.last_logits is not None:
                self.last_logits = None
            return dropped

    def prefill_pending(self) -> int:
        """Encode every token whose KV is pending (a generated answer's end of turn); returns how many.

        Call with the session's lock held; a fork calls it on its parent before sharing the cache.
        """
        with self.lock:
            return self._prefill()

    def _prefill(self) -> int:
        """Encode every token whose KV is pending; returns how many."""
        feed = Feed.pending(self.spans)
        if not len(feed):
            return 0
        physical = self.store.physical
        physical.compact_pending()
        encoded_before = self.counters.prefill_tokens
        feed = start_from_shared_prefix(self, feed)  # threads that start alike share that KV
        mask = None
        if physical.length and min(feed.positions) < int(physical.slot_position.max()):
            # A span whose tail was still pending (a generated answer's last token and
            # end-of-turn) was restored or recomputed after later messages were encoded:
            # its tail must not attend to them. Attend by logical position instead.
            mask = self.runner.logical_mask(physical, feed.positions)
        with self.backend.model_lock:
            self.last_logits = (
                self.forward(feed, attention_mask=mask) if mask is not None else self.forward(feed)
            )
        for span in self.spans:
            if span.tier.attended and span.n_computed < span.length:
                span.mark_computed()
        self.counters.prefill_tokens += len(feed)
        return self.counters.prefill_tokens - encoded_before

    def forward(self, feed: Feed, **kwargs: Any) -> torch.Tensor | None:
        """Run `feed` through the model over this session's cache (the caller holds `model_lock`).

        Charges the time to `forward_seconds`, and collects the attention signal on
        prefills when the policy uses it.
        """
        before = self.runner.forward_seconds
        self.store.physical.compact_pending()  # a forward must never attend a removed slot
        self.counters.encoded_tokens += len(feed)
        try:
            return self.runner.forward_observed(
                self.store.physical, feed, self.manager.policy, window=self.config.commit.window, **kwargs
            )
        finally:
            self.counters.forward_seconds += self.runner.forward_seconds - before

    # -- decoding ------------------------------------------------------------------------------

    def generate(self, max_new_tokens: int = 256, **options: Unpack[AnswerOptions]) -> str:
        """Answer as the assistant; the answer becomes a cached assistant span.

        Takes the options of `stream` (temperature, top_p, top_k, stop, prefix, seed,
        message_id, logits_processor) and returns the whole text, without `prefix` and
        stop strings.
        """
        return "".join(self.stream(max_new_tokens, **options))

    def stream(self, max_new_tokens: int = 256, **options: Unpack[AnswerOptions]) -> Iterator[str]:
        """Answer as the assistant, yielding text pieces as they are decoded.

        Args:
            max_new_tokens: at most this many new tokens (>= 1).
            temperature: 0 = greedy; otherwise sample with `top_p` / `top_k`.
            top_p: nucleus sampling threshold.
            top_k: keep only the k most likely tokens (0 = off).
            stop: strings that end the answer (excluded from it).
            prefix: the answer starts with this text (e.g. a forced tool call opening);
                the pieces exclude it.
            seed: seeds the sampler.
            message_id: id of the message that will carry this answer (span owner).
            logits_processor: `(generated ids, logits [V]) -> logits`, applied before each
                pick (e.g. to forbid a tool-call tag while letting the answer go on).

        The session lock is held from the first piece until the stream ends, so other
        calls on this session wait meanwhile. Iterate it to the end, or `close()` it, on
        the thread that started it: an `RLock` can only be released by its owner, so
        stepping one stream from several pool threads fails when it ends.
        """
        params, prefix, message_id = SamplingParams.from_options(max_new_tokens, options)
        turn_ends = tuple(text for text in self.format.stop_strings() if text not in params.stop)
        if turn_ends:
            params = replace(params, stop=params.stop + turn_ends)
        return self._decode(params, prefix, message_id)

    def _decode(self, params: SamplingParams, prefix: str, message_id: str | None) -> Iterator[str]:
        with self.lock:
            span, prompt_tokens = self._open_answer(prefix, message_id, params.max_new_tokens)
            deferred, self.prefill_deferred = self.prefill_deferred, False
            try:
                self._prefill()  # the deferred messages and the generation prompt: one forward
            except BaseException:
                # No answer was started: take the prompt span back, so spans and messages stay aligned.
                self.table.remove(span)
                self.manager.on_span_removed(span)
                self.store.forget(span)
                raise
            self.last_prompt = PromptRead(self.store.physical.length, self.counters.encoded_tokens)
            if deferred:
                self.manager.after_operation()  # the budget check `extend` would have made
            logits = self.last_logits
            if logits is None:
                msg = "no logits after prefill"
                raise RuntimeError(msg)
            answer = Answer()

            def step(token: int) -> torch.Tensor:
                span.token_ids.append(token)
                return self._decode_one(span)

            try:
                yield from decode_answer(
                    logits,
                    step,
                    params,
                    self.backend.tokenizer,
                    self.format.stop_token_ids(),
                    answer,
                    self.format.hidden_special_ids,
                )
            finally:
                # The last produced token was not fed back: it is encoded with the end of turn.
                span.token_ids.extend(answer.tokens[len(span.token_ids) - prompt_tokens :])
                if answer.kept is not None:
                    self._cut_stop_string(span, prompt_tokens + answer.kept, answer.tail)
                self._finish_answer(span, prefix, answer.text, len(answer.tokens), computed=False)

    def _cut_stop_string(self, span: Span, keep: int, tail: str) -> None:
        """Take an answer's stop string back out of its span: ids and KV, so the history holds its message.

        `keep`: the span's ids the answer's text starts with; `tail`: the text's end those
        ids do not spell (the stop string began inside a token), encoded anew (pending).
        """
        if keep < span.n_computed:
            self.manager.mover.cut(span, keep)
            self.last_logits = None  # they followed a stop string's token
        span.token_ids = span.token_ids[:keep] + (self.format.encode(tail) if tail else [])
        span.n_computed = min(span.n_computed, keep)

    def _decode_one(self, span: Span) -> torch.Tensor:
        """Feed the span's last produced token (pending); return next-token logits `[V]`."""
        offset = span.length - 1
        feed = Feed([span.token_ids[offset]], [span.start + offset], [span.span_id], [offset])
        with self.backend.model_lock:
            logits = self.forward(feed)
        span.mark_computed()
        if logits is None:
            msg = "no logits from decode step"
            raise RuntimeError(msg)
        return logits

    # -- scoring without changing the cache ------------------------------------------------------

    def continuation_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits `[n, V]` for feeding `token_ids` after the cache; the cache is left as it was.

        Row i is the distribution after token i; the row before token 0 is
        `self.last_logits`. Used for exactness checks and teacher-forced scoring.
        """
        with self.lock:
            self._check_open()
            prefilled = self._prefill() if Feed.pending(self.spans).input_ids else 0
            start = self.logical_length
            ids = list(token_ids)
            feed = Feed(ids, list(range(start, start + len(ids))), [-1] * len(ids), list(range(len(ids))))
            before = self.store.physical.length
            try:
                # The tokens are taken back: the sliding KV they would outdate stays.
                with self.backend.model_lock, self.store.physical.whole_window():
                    logits = self.runner.forward(self.store.physical, feed, logits="all")
            finally:
                self.store.physical.truncate(before)
            if prefilled:
                # Encoding the pending tail (a generated answer's end of turn) grew the cache: the
                # budget is enforced now, after scoring, as generate() does after an answer, so the
                # scores are those a decode would see.
                self.manager.after_operation()
            if logits is None:
                return torch.empty(0)
            return logits

    def answer_logprob(self, answer: str, *, prefix: str = "") -> float:
        """Teacher-forced log-probability of an assistant answer (cache unchanged)."""
        with self.lock:
            prompt = self.format.generation_prompt_ids(self.messages) + self.format.encode(prefix)
            target = self.format.encode(answer)
            logits = self.continuation_logits(prompt + target)
            if self.last_logits is None:
                return float("nan")
            return answer_logprob(self.last_logits, logits, prompt, target)

    # -- lifecycle ------------------------------------------------------------------------------

    def _apply_locked(self, event: Event, *, enforce: bool) -> ApplyResult:
        """Apply one event with the lock held: forget requests, a conversation's end, a turn's end."""
        if isinstance(event, ForgetRequested):
            return self.forget.request(event)
        result = self.manager.apply(event, enforce=enforce)
        if isinstance(event, SessionClosed):
            self.ended = True  # the next call brings the released history back (`_restart`)
        if isinstance(event, TurnEnded) and event.turn in (None, self.turn):
            self.forget.on_turn_ended()
        return result

    def detach(self, session_id: str) -> None:
        """Stand alone as the conversation `session_id` (a branch adopted by its thread).

        The shared prefix stays referenced by this session's cache, so the old parent
        can close; the branch tags of the spans are cleared, so a late hint naming the
        branch cannot release what is now the thread's own history.
        """
        with self.lock:
            self.table.record("branch", adopted_as=session_id, was=self.session_id)
            if self.parent is not None:
                # The thread's totals go on from the parent's: the branch counted only its own work.
                self.counters.add(self.parent.counters)
            self.session_id = session_id
            self.table.session_id = session_id
            self.parent = None
            self.branch = None
            for span in self.spans:
                span.branch = None

    def _fork_from(self, parent: Session) -> None:
        with parent.lock:
            if parent.prefill_pending():
                parent.manager.after_operation()
            self.store = parent.store.fork()
            self.store.physical.context_source = self.context_ids
            self.table = parent.table.fork(self.session_id)
            self.last_logits = parent.last_logits
            self.manager = LifecycleManager(SessionServices(self), self.limits)
            for clone in self.table.spans:
                # Archived blocks are not copied: the child evicts those spans (recomputable from
                # their tokens), so its states still say where its KV is.
                if clone.tier.archived:
                    self.manager.move(clone, SpanState.EVICTED, reason="fork: archive not copied")
            self.manager.inherit(parent.manager)


def _attended(span: Span) -> int:
    """Tokens of a span whose KV the model attends now (computed, held at full precision or attended int4)."""
    if not span.tier.attended or span.state not in ATTENDED_STATES:
        return 0
    return min(span.held_tokens, span.n_computed)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
