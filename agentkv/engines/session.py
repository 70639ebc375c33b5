"""`EngineSession`: one conversation on a served engine, with the same lifecycle as a local one.

The session keeps what a local session keeps (a `SpanTable` of token ids, messages,
leases, counters) and the same `LifecycleManager` moves its spans on events, budgets
and recalls. Only "where KV lives" differs: the store is an `EngineStore`, so a move
becomes a pin, a delete or a prefetch on LMCache, and the prompt the engine sees is
the attended spans' token ids. `generate` syncs those hints and asks vLLM for the
answer; the engine's own usage figures become the session's prefill / reuse counters.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any, Protocol, Unpack

from agentkv.backend.contracts import BackendHost, ExtendResult
from agentkv.backend.decoding import kept_tokens
from agentkv.backend.port_base import SessionServicesBase
from agentkv.backend.sampling import AnswerOptions, SamplingParams
from agentkv.backend.session_core import SessionCore
from agentkv.engines.admission import Admission, AdmissionGate
from agentkv.engines.fleet import EngineFleet, Route
from agentkv.engines.http import EngineUnavailableError
from agentkv.engines.store import EngineStore, EngineTarget, common_prefix
from agentkv.engines.vllm import Completion
from agentkv.events import Event, SessionClosed, TurnEnded, validate_event
from agentkv.lifecycle import ApplyResult, LifecycleManager, SpanTable
from agentkv.metrics import SessionStats
from agentkv.spans import Span, SpanState

logger = logging.getLogger("agentkv.engines")


class EngineHost(BackendHost, Protocol):
    """What an engine session needs from its backend beyond any host's (`EngineBackend` provides it)."""

    fleet: EngineFleet
    gate: AdmissionGate | None

    def salt_for(self, session_id: str, *, share: bool = True) -> str:
        """The conversation's `cache_salt` (`share=False`: its own even under `salt: shared`)."""
        ...

    def route(self, session: Any, exclude: Sequence[int] = ()) -> Route:
        """Where the session's next call goes (`EngineFleet.route`)."""
        ...

    def target(self) -> EngineTarget | None:
        """The LMCache instance hints go to (None = no coordinator)."""
        ...

    def sole_holder(self, session: Any) -> bool:
        """Whether `session` is the only live session on its `cache_salt` (its pins are all its own)."""
        ...


class EngineServices(SessionServicesBase["EngineSession"]):
    """The `SessionPort` the lifecycle manager uses, over an engine session."""

    def recompute(self, span: Span) -> None:
        """Nothing to do now: the span is back in the prompt, the engine computes it on the next call."""
        del span

    def background_logprobs(self) -> Any:
        """No model here: recall weighs words by their rarity in the session alone."""
        return None

    def token_embeddings(self) -> Any:
        """No model weights here: recall ranks by words only."""
        return None

    def global_device_bytes(self) -> int:
        """Engine KV bytes across the backend's sessions."""
        return self.session.backend.device_bytes()

    def relieve_global(self, free_bytes: int) -> int:
        """Nothing to free outside the sessions: the engine's own cache is its business (0)."""
        del free_bytes
        return 0


class EngineSession(SessionCore):
    """One conversation on the engine. Thread-safe: a per-session lock serialises every call."""

    backend: EngineHost
    store: EngineStore

    def _start(self, parent: EngineSession | None) -> None:
        """The engine's salt and an `EngineStore`; a branch shares its parent's salt and prompt."""
        backend, session_id = self.backend, self.session_id
        # Branches of a conversation share its salt: the engine shares their prefix (no copy).
        share = self.config.prefix_cache.enabled
        self.cache_salt: str = (
            parent.cache_salt if parent is not None else backend.salt_for(session_id, share=share)
        )
        self.engine_sequence: list[int] = list(parent.engine_sequence) if parent is not None else []
        """Token ids of this session's last engine call (prompt and answer): its own cached prefix."""
        self.conversation_id: str = parent.conversation_id if parent is not None else session_id
        """The root conversation: branches share its residency at the admission gate."""
        self.last_admission: Admission | None = None
        """What the admission gate answered for the last call (None without a gate)."""
        self.engine_index: int | None = None
        """The fleet engine this conversation's calls go to (None before its first call)."""
        self.last_route: Route | None = None
        """Where the last call went and why (`stats().engine`, `stats().route`)."""
        self.ended = False
        """True after `SessionClosed` until the next answer brings the released history back."""
        if parent is None:
            self.table = SpanTable(session_id)
            shared: list[int] = []
        else:
            with parent.lock:
                self.table = parent.table.fork(session_id)
                shared = parent.store.prompt()
        self.store = EngineStore(
            backend.target(),
            self.cache_salt,
            lambda: self.table.spans,
            backend.bytes_per_token,
            shared_prefix=shared,
            owner=session_id,
            owns_salt=lambda: backend.sole_holder(self),
            on_failure=self._hint_failed,
        )
        self.manager = LifecycleManager(EngineServices(self), self.limits)
        if parent is not None:
            self.manager.inherit(parent.manager)

    def _attended_tokens(self) -> tuple[int, int]:
        return sum(s.length for s in self.spans if s.tier.attended), 0

    def _hint_failed(self, what: str, error: Exception) -> None:
        """A hint the engine did not take is a survived fault of this session (counted and logged)."""
        self.counters.faults += 1
        self.table.record("fault", where=f"engine hint {what}", span=None, error=repr(error))

    # -- encoding: spans only, the engine computes KV on the next call ---------------------------

    def extend(
        self, messages: Sequence[Any], *, prefill: bool = True, events: Sequence[Event] = ()
    ) -> ExtendResult:
        """Bring the span table in line with `messages` (matched by fingerprint; crop at the first change).

        `prefill` is accepted for the `Session.extend` signature and has no effect: the
        engine encodes the prompt when it is asked to generate, in one request either way.
        `events` arrive with the messages and are applied before recall and the budget
        plan for them, as in `Session.extend`.
        """
        started = time.perf_counter()
        for event in events:  # before anything changes; the manager trusts them
            validate_event(event)
        with self.lock:
            incoming, message_spans, k, texts = self._match(messages)
            reused = sum(s.length for s in message_spans[:k])
            cropped = self._crop(message_spans[k]) if k < len(message_spans) else 0
            new_ids = [self.format.encode(text) for text in texts]
            new_spans: list[int] = []
            for offset, (message, ids) in enumerate(zip(incoming[k:], new_ids, strict=True)):
                self._count_turn(message)
                span = self._new_span(message.kind, ids, text=texts[offset])
                span.n_computed = len(ids)  # held by the prompt; the engine computes or reuses it
                self._describe_message(span, message, k + offset)
                self.manager.on_span_created(span)
                self.messages.append(message)
                new_spans.append(span.span_id)
            applied = tuple(self.manager.apply(event, enforce=False) for event in events)
            if any(m.role == "user" for m in incoming[k:]):
                self.manager.recall(incoming[-1])
            self.counters.cropped_tokens += cropped
            self.manager.after_operation()
            self.table.record("extend", prefilled=0, reused=reused, cropped=cropped, spans=new_spans)
            return ExtendResult(
                prefilled_tokens=0,
                reused_tokens=reused,
                cropped_tokens=cropped,
                new_spans=tuple(new_spans),
                first_changed_message=k if k < len(message_spans) else None,
                seconds=time.perf_counter() - started,
                applied=applied,
            )

    def _crop(self, first: Span) -> int:
        """Drop `first` and every span after it (a history rewrite): their engine tails are stale."""
        index = self.spans.index(first)
        dropped = 0
        for span in self.spans[index:]:
            dropped += span.length
            self.store.forget(span)
            self.manager.on_span_removed(span)
        self.table.truncate(index)
        self.table.truncate_messages(first.message_index if first.message_index >= 0 else len(self.messages))
        return dropped

    # -- decoding on the engine ------------------------------------------------------------------

    def generate(self, max_new_tokens: int = 256, **options: Unpack[AnswerOptions]) -> str:
        """Answer as the assistant on the engine (greedy); the answer becomes an assistant span.

        Raises:
            ValueError: nothing to answer, `max_new_tokens < 1`, or `temperature != 0` (the engine
                path decodes greedily: answers must match across runs).
            EngineUnavailableError / EngineRequestError: vLLM did not answer (the agent needs it).
        """
        # top_p / top_k / seed are ignored: greedy decoding does not read them, as a local session.
        params, prefix, message_id = SamplingParams.from_options(max_new_tokens, options)
        if params.temperature != 0.0:
            msg = f"temperature: engine sessions decode greedily (0.0), got {params.temperature}"
            raise ValueError(msg)
        stops = list(params.stop) + [text for text in self.format.stop_strings() if text not in params.stop]
        with self.lock:
            span, prompt_tokens = self._open_answer(prefix, message_id, max_new_tokens)
            span.n_computed = prompt_tokens  # the prompt holds it; the engine computes or reuses it
            prompt = self.store.prompt()
            gate = self.backend.gate
            if gate is not None:  # waits while the residents' working sets fill the cache (bounded)
                self.last_admission = gate.acquire(self.conversation_id, len(prompt))
            try:
                done = self._complete(prompt, max_new_tokens, stops)
            except BaseException:
                self.table.remove(span)  # no answer was started: spans and messages stay aligned
                self.manager.on_span_removed(span)
                if gate is not None:
                    gate.call_done(self.conversation_id, len(prompt))
                raise
            produced = self._answer_ids(done)
            if gate is not None:
                gate.call_done(self.conversation_id, len(prompt) + len(produced))
            span.token_ids.extend(produced)
            span.n_computed = span.length
            self.store.completed(prompt + produced)
            self.counters.prefill_tokens += max(0, done.prompt_tokens - done.cached_tokens)
            self.counters.reused_tokens += done.cached_tokens
            # Cached tokens past what this session itself sent came from another session's
            # prompt: the engine's prefix cache shared them (the field the local backend fills).
            own = common_prefix(self.engine_sequence, prompt)
            self.counters.shared_prefix_tokens += max(0, done.cached_tokens - own)
            self.engine_sequence = prompt + produced
            self._finish_answer(span, prefix, done.text, len(produced), computed=True)
            return done.text

    def _answer_ids(self, done: Completion) -> list[int]:
        """The ids that spell the answer's text: no end-of-turn id, no stop string the engine cut off."""
        produced = [t for t in done.token_ids if t not in self.format.stop_token_ids()]
        tokenizer = self.backend.tokenizer

        def decode(ids: list[int]) -> str:
            return str(tokenizer.decode(ids, skip_special_tokens=True))

        said = decode(produced)
        if done.finish_reason != "stop" or said == done.text or not said.startswith(done.text):
            return produced
        kept, tail = kept_tokens(produced, done.text, decode)
        return produced[:kept] + self.format.encode(tail)

    def _complete(self, prompt: list[int], max_new_tokens: int, stops: list[str]) -> Completion:
        """Sync the hints and ask the fleet; an engine that does not answer hands the call to another.

        The call goes where `backend.route` says (this thread's engine while it is up). A
        moved thread's store prefetches its prompt (its history comes back from LMCache,
        which every engine shares) and re-sends what failed hints left (deletes, maybe-applied
        pins) before the call. Raises the last `EngineUnavailableError` once every engine
        failed this call.
        """
        tried: list[int] = []
        while True:
            route = self.backend.route(self, tried)  # places the session on `route.engine`
            if route.moved_from is not None:
                self.counters.engine_moves += 1
                self.store.moved()
                self.table.record("route", engine=route.engine, reason=route.reason, detail=route.detail)
            self.last_route = route
            self.store.sync(prompt)
            try:
                return self.backend.fleet.call(
                    route.engine,
                    lambda client: client.complete(
                        prompt,
                        max_tokens=max_new_tokens,
                        cache_salt=self.cache_salt or None,
                        stop=stops or None,
                    ),
                )
            except EngineUnavailableError:
                tried.append(route.engine)
                if len(tried) >= len(self.backend.fleet):
                    raise
                self.backend.fleet.stats.failovers += 1

    def _check_answer(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """After `SessionClosed` the conversation goes on: its released spans are in the prompt again.

        The engine computes them (or loads what LMCache still holds) with the next call,
        as the local backend recomputes them: an answer never reads a history the model
        does not attend.
        """
        del prompt_tokens, max_new_tokens
        if not self.ended:
            return
        self.ended = False
        for span in self.spans:
            if span.state in (SpanState.ARCHIVED, SpanState.EVICTED):
                self.manager.mover.move(span, SpanState.COMMITTED, reason="session_restarted", lazily=True)

    def stats(self) -> SessionStats:
        """`SessionReadout.stats` plus where the last call went and why (`engine`, `route`)."""
        stats = super().stats()
        route = self.last_route
        if route is None:
            return stats
        return replace(stats, engine=route.url, route=f"{route.reason}: {route.detail}")

    def stream(self, max_new_tokens: int = 256, **options: Unpack[AnswerOptions]) -> Iterator[str]:
        """`generate` as one piece (the engine path does not stream token by token)."""
        yield self.generate(max_new_tokens, **options)

    # -- lifecycle -------------------------------------------------------------------------------

    def _apply_locked(self, event: Event, *, enforce: bool) -> ApplyResult:
        """Apply one event with the lock held; the engine hears of it on the next call (`EngineStore.sync`).

        `TurnEnded` pins what the turn committed at once (`EngineStore.refit_pins`), then
        parks the conversation (`EngineStore.park`): the chunks its pin keeps on L2 give up
        their L1 copy until the next call prefetches them back. With an admission gate, a
        conversation that stays resident is not parked (it calls again soon: its L1 copies
        are what that call reads); one that gives its place up gets its pin refitted to its
        new share (the residents' room).
        """
        result = super()._apply_locked(event, enforce=enforce)
        if isinstance(event, SessionClosed):
            self.ended = True  # the next answer brings the released history back (`_check_answer`)
        if isinstance(event, TurnEnded):
            gate = self.backend.gate
            working_set = len(self.store.prompt())
            resident = gate is not None and gate.turn_ended(self.conversation_id, working_set)
            self.store.refit_pins()  # the turn's committed history, pinned before park frees L1
            if not resident:
                self.store.park()  # the conversation now waits: L1 room goes to others
        return result

    def detach(self, session_id: str) -> None:
        """Stand alone as the conversation `session_id` (a branch adopted by its thread), on its own engine.

        The branch keeps the engine it ran on (branches may spread over a fleet: the
        thread goes on where the winner's KV is warm); the prefix it shared becomes its own.
        """
        with self.lock:
            self.table.record("branch", adopted_as=session_id, was=self.session_id)
            if self.parent is not None:
                self.counters.add(self.parent.counters)
            self.session_id = session_id
            self.table.session_id = session_id
            self.parent = None
            self.branch = None
            for span in self.spans:
                span.branch = None
            self.store.stand_alone(session_id)
            if self.engine_index is not None:
                url = self.backend.fleet.engines[self.engine_index].url
                self.last_route = Route(
                    self.engine_index, url, "adopted", f"the thread goes on on engine {self.engine_index}"
                )

    def close(self, *, spare: Sequence[Sequence[int]] = ()) -> None:
        """Unpin and delete this session's KV on the engine; forget its spans.

        The chunks it shares with the live sessions of its conversation (the thread, sibling
        branches) and with `spare` (the sequence an adopted branch goes on with) stay.
        Pin requests that timed out (maybe applied) and could not be checked yet go to the
        root conversation, which checks them once it holds the salt alone.
        """
        kin = [
            list(other.store.sent)
            for other in self.backend.sessions()
            if other is not self and not other.closed and other.conversation_id == self.conversation_id
        ]
        with self.lock:
            self.store.close(spare=[*spare, *kin])
            self.table.clear()
            self.closed = True
        with self.lock:
            uncertain, self.store.uncertain_pins = self.store.uncertain_pins, []
            gate = self.backend.gate
            if gate is not None and self.parent is None:  # a branch shares its root's residency
                gate.release(self.conversation_id)
        if uncertain and self.parent is not None and not self.parent.closed:
            with self.parent.lock:
                self.parent.store.adopt_uncertain(uncertain)
        elif uncertain:
            logger.warning(
                "session %s closed with %d pin requests the coordinator may have applied on salt %r "
                "(not checked: it did not answer, or another session shares the salt)",
                self.session_id,
                len(uncertain),
                self.cache_salt,
            )
