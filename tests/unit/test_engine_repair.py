"""What failed hints and mixed steps leave behind on the engine, against the simulated LMCache.

- A pin that timed out may still be applied when the coordinator resumes: the salt's sole
  holder checks the pin table and gives back only the surplus references.
- A release and an archive in one step: L2 keeps the archived chunks before the first
  dropped span; `host_bytes` counts only what it keeps.
- The turn's committed history is pinned at the turn end, before park.
- Deletes skipped during an outage are sent again; close removes every sequence written.
- Hint failures are faults of the session; `usage_metadata` is the engine's own usage.
"""

from __future__ import annotations

from typing import Any

import pytest

from agentkv.engines.http import EngineUnavailableError
from agentkv.engines.reconcile import surplus_sequences
from agentkv.spans import SpanState, Tier
from tests.unit.test_engine_store import (
    CHUNK,
    SimLMCache,
    make_backend,
    make_spans,
    make_store,
    restore,
    turn,
)


@pytest.fixture
def sim() -> SimLMCache:
    return SimLMCache()


def slow_coordinator(sim: SimLMCache, route: str, *, applied: bool) -> None:
    """The coordinator times out on `route`; with `applied`, the request lands anyway (it resumes later)."""
    handler = sim.transport.routes[route]

    def late(method: str, path: str, body: Any) -> Any:
        if applied:
            handler(method, path, body)
        msg = f"{method} {path}: no answer within 1 s (timed out)"
        raise EngineUnavailableError(msg)

    sim.transport.routes[route] = late


def answers_again(sim: SimLMCache, route: str, handler: Any) -> None:
    sim.transport.routes[route] = handler


# -- maybe-applied pins ---------------------------------------------------------------------------


def test_surplus_is_a_reference_on_every_chunk_beyond_the_books() -> None:
    a = list(range(16))  # 4 chunks
    b = [*a[:8], 90, 91, 92, 93]  # shares chunks 0-1 with a
    # Books hold a; the coordinator shows one more on a's chunks: a timed-out pin of a landed.
    assert surplus_sequences([a], [a], [[2, 2, 2, 2]], CHUNK) == [0]
    # b's shared chunks carry a's reference only, its own chunk none: b was never applied.
    assert surplus_sequences([b], [a], [[1, 1, 0]], CHUNK) == []
    # Two timed-out pins, both applied: each is given back once.
    assert surplus_sequences([a, b], [], [[1, 1, 1, 1], [2, 2, 1]], CHUNK) == [0, 1]
    # Only one reference beyond the books on the shared chunks: the second is not surplus.
    assert surplus_sequences([a, b], [], [[1, 1, 1, 1], [1, 1, 1]], CHUNK) == [0]
    with pytest.raises(ValueError, match="expected 1 count lists"):
        surplus_sequences([a], [], [], CHUNK)


def test_a_timed_out_pin_that_lands_later_is_given_back_at_the_next_sync(sim: SimLMCache) -> None:
    spans = make_spans(8, 8, 8)
    store = make_store(sim, spans, owns_salt=lambda: True)
    turn(store, sim)
    pin_route = sim.transport.routes["POST /cache/pins"]
    slow_coordinator(sim, "POST /cache/pins", applied=True)
    spans[0].state = spans[1].state = SpanState.COMMITTED
    turn(store, sim)
    assert store.stats.hint_failures == 1 and store.uncertain_pins
    assert sim.pins  # applied on the coordinator, not in the store's books
    answers_again(sim, "POST /cache/pins", pin_route)
    turn(store, sim)  # the pin table shows the surplus reference: given back, then the pin is placed
    assert store.stats.reconciled_unpins == 1 and not store.uncertain_pins
    assert set(sim.pins.values()) == {1}
    store.close()
    assert sim.pins == {}


def test_a_timed_out_pin_that_never_landed_takes_no_ones_reference(sim: SimLMCache) -> None:
    spans = make_spans(8, 8, 8)
    store = make_store(sim, spans, owns_salt=lambda: True)
    turn(store, sim)
    spans[0].state = SpanState.COMMITTED
    turn(store, sim)  # commit pin on chunks 0-1
    pin_route = sim.transport.routes["POST /cache/pins"]
    slow_coordinator(sim, "POST /cache/pins", applied=False)
    spans[1].state = SpanState.COMMITTED
    turn(store, sim)  # the longer pin fails and never lands; the old one stays in the books
    answers_again(sim, "POST /cache/pins", pin_route)
    before = dict(sim.pins)
    store.reconcile_pins()
    assert sim.pins == before and store.stats.reconciled_unpins == 0 and not store.uncertain_pins


def test_only_the_salts_sole_holder_reconciles(sim: SimLMCache, tiny_tokenizer: Any) -> None:
    backend = make_backend(sim, tiny_tokenizer)
    root = backend.session("t1")
    root.extend([{"role": "system", "content": "Be brief. " * 6}, {"role": "user", "content": "Hi?"}])
    root.generate(2)
    branch = root.fork("b1")
    assert not backend.sole_holder(root) and not backend.sole_holder(branch)
    branch.store.uncertain_pins.append(root.store.prompt()[:CHUNK])
    backend.close(branch.session_id)  # the branch hands its unchecked pins to the root
    assert root.store.uncertain_pins == [root.store.prompt()[:CHUNK]]
    assert backend.sole_holder(root)
    shared = make_backend(sim, tiny_tokenizer, engine={"salt": "shared"} | _engine())
    assert not shared.sole_holder(shared.session("alone"))


def _engine() -> dict[str, Any]:
    from tests.unit.test_engine_store import COORD

    return {"vllm_url": "http://v:8000", "coordinator_url": COORD, "chunk_size": CHUNK}


# -- release and archive in one step ---------------------------------------------------------------


def test_release_and_archive_in_one_step_keep_the_archived_chunks_on_l2(sim: SimLMCache) -> None:
    spans = make_spans(8, 8, 8, 8)
    store = make_store(sim, spans)
    old = turn(store, sim)
    spans[1].tier = store.archive(spans[1], "host")  # older span archived ...
    spans[2].tier = store.drop(spans[2])  # ... and a later one released, in the same step
    turn(store, sim)
    held = sim.held(old, "salt")
    assert held[:2] == [{"l1", "l2"}] * 2  # the prompt's prefix
    assert held[2:4] == [{"l2"}] * 2  # the archived span: L2 keeps it (L1 copy given up) ...
    assert set(sim.keys(old[:16], "salt")) <= set(sim.pins)  # ... under an archive pin
    assert held[4:] == [set()] * 4  # from the released span on: gone from every tier
    assert store.host_bytes() == 8 * 10 == store.span_bytes(spans[1])
    restore(store, [spans[1]])
    turn(store, sim)
    assert sim.prefetched == [old[:16] + spans[3].token_ids]


def test_an_archived_span_after_the_released_one_is_not_counted_as_kept(sim: SimLMCache) -> None:
    spans = make_spans(8, 8, 8, 8)
    store = make_store(sim, spans)
    old = turn(store, sim)
    spans[1].tier = store.drop(spans[1])
    spans[2].tier = store.archive(spans[2], "host")  # its old chunks come after the released span: garbage
    turn(store, sim)
    assert sim.held(old, "salt")[2:] == [set()] * 6
    assert spans[2].tier is Tier.HOST and store.host_bytes() == 0 == store.span_bytes(spans[2])


# -- turn end, leftovers, faults -------------------------------------------------------------------


HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a rail assistant. " * 4},
    {"role": "user", "content": "Zurich to Vienna tonight?"},
]


def test_turn_end_pins_what_the_turn_committed_before_park(sim: SimLMCache, tiny_tokenizer: Any) -> None:
    from agentkv import TurnEnded

    backend = make_backend(sim, tiny_tokenizer)
    session = backend.session("t1")
    session.extend(HISTORY)
    session.generate(4)
    session.apply(TurnEnded())  # user + answer committed: pinned now, not at the next call
    committed = session.store.prompt()[: session.store.committed_length()]
    assert len(committed) >= 2 * CHUNK
    pinned = sim.transport.sent("POST", "/cache/pins")[-1]["token_ids"]
    assert pinned == committed[: len(committed) // CHUNK * CHUNK]
    assert set(sim.keys(pinned, "t1")) == set(sim.pins)
    backend.close("t1")
    assert sim.pins == {}


def test_a_delete_skipped_in_an_outage_is_sent_at_the_next_sync(sim: SimLMCache) -> None:
    spans = make_spans(8, 8, 8)
    store = make_store(sim, spans)
    old = [*turn(store, sim, generated=[7, 7, 7, 7]), 7, 7, 7, 7]
    spans[1].tier = store.drop(spans[1])
    sim.transport.down = True
    store.sync(store.prompt())  # the stale tail is not deleted: the coordinator does not answer
    sim.transport.down = False
    sim.store(store.prompt(), "salt")
    store.completed(store.prompt())
    assert sim.held(old, "salt")[2:] == [{"l1", "l2"}] * 5  # still there
    turn(store, sim)
    assert store.stats.retried_deletes == 1
    assert sim.held(old, "salt")[2:] == [set()] * 5


def test_close_removes_every_sequence_the_session_wrote(sim: SimLMCache) -> None:
    spans = make_spans(8, 8, 8)
    store = make_store(sim, spans)
    first = turn(store, sim)
    spans[1].tier = store.archive(spans[1], "host")  # the first sequence stays on L2 for a recall
    turn(store, sim)
    sim.transport.down = True
    spans[2].tier = store.drop(spans[2])
    store.sync(store.prompt())  # this delete is skipped
    sim.transport.down = False
    store.completed(store.prompt())
    store.close()
    assert not any(sim.held(first, "salt")) and sim.pins == {}
    assert all(not tiers for tiers in sim.tiers.values())


def test_hint_failures_are_faults_of_the_session(sim: SimLMCache, tiny_tokenizer: Any) -> None:
    backend = make_backend(sim, tiny_tokenizer)
    session = backend.session("t1")
    session.extend(HISTORY)
    session.generate(2)
    sim.transport.routes["POST /cache/pins"] = lambda *_: (_ for _ in ()).throw(
        EngineUnavailableError("POST /cache/pins: no answer within 1 s (timed out)")
    )
    from agentkv import TurnEnded

    session.apply(TurnEnded())  # the turn-end pin fails
    stats = session.stats()
    assert stats.faults == session.store.stats.hint_failures >= 1
    assert any(r.kind == "fault" and "engine hint pin" in r.detail["where"] for r in session.table.log)


def test_usage_metadata_is_what_the_engine_was_sent_and_reused(sim: SimLMCache, tiny_tokenizer: Any) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

    from agentkv import ToolCallCompleted
    from agentkv_langchain import ChatAgentKV

    backend = make_backend(sim, tiny_tokenizer)
    llm = ChatAgentKV(backend=backend, session_id="u1")
    call = AIMessage("", tool_calls=[{"id": "c1", "name": "timetable", "args": {}}], id="a1")
    history = [
        SystemMessage("You are a rail assistant. " * 4, id="s"),
        HumanMessage("Zurich to Vienna tonight?", id="h1"),
        call,
        ToolMessage("Nightjet 466 at 21:40, platform 7. " * 3, tool_call_id="c1", id="t1"),
    ]
    llm.invoke(history)
    backend.apply("u1", ToolCallCompleted("c1"))  # the call's scaffolding leaves the prompt
    before = backend.get("u1").stats()
    answer = llm.invoke([*history, AIMessage(" ok", id="a2"), HumanMessage("Price?", id="h2")])
    after = backend.get("u1").stats()
    body = sim.transport.sent("POST", "/v1/completions")[-1]
    usage = answer.usage_metadata
    assert usage is not None
    assert usage["input_tokens"] == len(body["prompt"])  # what the engine was sent ...
    assert usage["input_tokens"] < backend.get("u1").table.logical_length  # ... not the logical history
    cached = after.reused_tokens - before.reused_tokens
    assert usage["input_token_details"]["cache_read"] == cached > 0
    assert usage["input_tokens"] == after.prefill_tokens - before.prefill_tokens + cached


def test_a_recall_and_a_release_in_one_step_delete_the_whole_old_tail(sim: SimLMCache) -> None:
    spans = make_spans(8, 8, 8, 8)
    store = make_store(sim, spans)
    turn(store, sim)
    spans[1].tier = store.archive(spans[1], "host")
    old = turn(store, sim)  # spans 0, 2, 3
    restore(store, [spans[1]])  # the prompt changes at span 1's place ...
    spans[3].tier = store.drop(spans[3])  # ... and span 3 is released: nothing of the old tail is kept
    turn(store, sim)
    assert sim.held(old, "salt")[2:] == [set()] * 4


def test_an_archive_pin_shared_by_two_spans_is_given_back_once(sim: SimLMCache) -> None:
    spans = make_spans(8, 8, 8, 8)
    store = make_store(sim, spans)
    spans[0].state = SpanState.COMMITTED
    turn(store, sim)  # commit pin on span 0's chunks
    spans[1].tier = store.archive(spans[1], "host")
    spans[2].tier = store.archive(spans[2], "host")  # one step: one archive pin serves both
    turn(store, sim)
    restore(store, [spans[1], spans[2]])
    turn(store, sim)
    commit_keys = sim.keys(spans[0].token_ids, "salt")
    assert [sim.pins.get(k) for k in commit_keys] == [1, 1]  # the commit pin's reference survives
    assert set(sim.pins) == set(commit_keys)
