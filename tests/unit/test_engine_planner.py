"""`EnginePinPlanner`: one L2 pin budget for the conversations of a backend.

The planner alone (grants), then with `EngineStore`s against the simulated LMCache of
`test_engine_store.py`: what the coordinator's pin table holds after real syncs.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from agentkv.engines.lmcache import CoordinatorClient
from agentkv.engines.planner import EnginePinPlanner
from agentkv.engines.store import EngineStore, EngineTarget
from agentkv.spans import Span, SpanKind, SpanState
from tests.unit.test_engine_store import CHUNK, COORD, NODE, SimLMCache


def test_grants_whole_histories_in_order_of_arrival_until_the_budget_is_spent() -> None:
    planner = EnginePinPlanner(budget_tokens=100, chunk_size=10)
    assert planner.grant("a", 45) == 40  # whole chunks only
    assert planner.grant("b", 30) == 30
    assert planner.grant("c", 50) == 30  # what is left
    assert planner.grant("d", 20) == 0
    assert planner.shares() == {"a": 40, "b": 30, "c": 30, "d": 0}


def test_an_earlier_conversation_growing_takes_room_from_the_latest_ones() -> None:
    planner = EnginePinPlanner(budget_tokens=100, chunk_size=10)
    for owner in "abc":
        planner.grant(owner, 30)
    assert planner.grant("a", 60) == 60
    assert planner.shares() == {"a": 60, "b": 30, "c": 10}
    planner.release("a")  # closed: the next ones move up
    assert planner.shares() == {"b": 30, "c": 30}
    planner.release("nobody")  # unknown owner: no-op
    assert planner.grant("a", 60) == 40  # back, but now last in line


def test_invalid_arguments_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="budget_tokens: expected an int >= 0, got -1"):
        EnginePinPlanner(-1, 64)
    with pytest.raises(ValueError, match="chunk_size: expected an int > 0, got 0"):
        EnginePinPlanner(64, 0)
    with pytest.raises(ValueError, match="wanted_tokens: expected >= 0, got -5"):
        EnginePinPlanner(64, 64).grant("a", -5)


def test_concurrent_grants_never_exceed_the_budget() -> None:
    planner = EnginePinPlanner(budget_tokens=1000, chunk_size=10)
    barrier = threading.Barrier(8)

    def ask(i: int) -> None:
        barrier.wait()
        for wanted in range(0, 400, 10):
            planner.grant(f"c{i}", wanted)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    shares = planner.shares()
    assert sum(shares.values()) == 1000
    assert sorted(shares.values(), reverse=True)[:2] == [390, 390]


def _conversation(first_id: int, lengths: list[int]) -> list[Span]:
    spans, start = [], 0
    for i, n in enumerate(lengths):
        ids = list(range(first_id + 100 * i, first_id + 100 * i + n))
        spans.append(Span(span_id=i, kind=SpanKind.USER, token_ids=ids, start=start, n_computed=n))
        start += n
    return spans


def _store(sim: SimLMCache, planner: EnginePinPlanner, owner: str, spans: list[Span]) -> EngineStore:
    coordinator = CoordinatorClient(COORD, "m", transport=sim.transport)
    target = EngineTarget(coordinator, "i0", NODE, chunk_size=CHUNK, prefetch_wait=0.5, planner=planner)
    # One salt for the fleet (engine.salt: shared): the owner tells the planner who asks.
    return EngineStore(target, "fleet", lambda: spans, bytes_per_token=10, owner=owner)


def _call(store: EngineStore, sim: SimLMCache) -> list[int]:
    prompt = store.prompt()
    store.sync(prompt)
    sim.store(prompt, "fleet")
    store.completed(prompt)
    return prompt


def test_stores_pin_whole_committed_histories_of_the_first_conversations_only() -> None:
    sim = SimLMCache()
    planner = EnginePinPlanner(budget_tokens=6 * CHUNK, chunk_size=CHUNK)
    conversations = {name: _conversation(1000 * (i + 1), [8, 4, 3]) for i, name in enumerate("abc")}
    stores = {name: _store(sim, planner, name, spans) for name, spans in conversations.items()}
    for name, spans in conversations.items():
        _call(stores[name], sim)
        spans[0].state = spans[1].state = SpanState.COMMITTED  # 12 tokens = 3 whole chunks
    prompts = {name: _call(stores[name], sim) for name in "abc"}
    keys = {name: sim.keys(prompts[name][:12], "fleet") for name in "abc"}
    assert all(sim.pins.get(k) == 1 for k in keys["a"] + keys["b"])  # whole histories
    assert not any(k in sim.pins for k in keys["c"])  # no room left: c pins nothing
    assert len(sim.pins) == 6

    stores["a"].close()  # a leaves: c moves up and pins at its next call
    assert planner.shares() == {"b": 12, "c": 12}
    _call(stores["c"], sim)
    assert all(sim.pins.get(k) == 1 for k in keys["c"])
    assert not any(k in sim.pins for k in keys["a"])
    assert len(sim.pins) == 6


def test_a_conversation_that_lost_room_shrinks_its_pin_at_its_next_call() -> None:
    sim = SimLMCache()
    planner = EnginePinPlanner(budget_tokens=6 * CHUNK, chunk_size=CHUNK)
    a_spans, b_spans = _conversation(1000, [8, 4, 8]), _conversation(2000, [8, 4])
    a, b = _store(sim, planner, "a", a_spans), _store(sim, planner, "b", b_spans)
    for spans, store in ((a_spans, a), (b_spans, b)):
        spans[0].state = spans[1].state = SpanState.COMMITTED
        _call(store, sim)
    assert planner.shares() == {"a": 12, "b": 12}
    a_spans[2].state = SpanState.COMMITTED  # a's history grows to 5 chunks: b keeps 1
    a_prompt = _call(a, sim)
    assert all(sim.pins.get(k) == 1 for k in sim.keys(a_prompt[:20], "fleet"))
    b_prompt = _call(b, sim)
    b_keys = sim.keys(b_prompt[:12], "fleet")
    assert [k in sim.pins for k in b_keys] == [True, False, False]  # its head, within what is left
    assert len(sim.pins) == 6
    assert a.stats.hint_failures == b.stats.hint_failures == 0


def test_backend_sessions_share_one_planner_and_the_runs_salt(tiny_tokenizer: Any) -> None:
    from agentkv import AgentKVConfig, TurnEnded
    from agentkv.engines import EngineBackend
    from tests.unit.test_engine_store import fake_engine

    sim = SimLMCache()
    engine = {
        "vllm_url": "http://v:8000",
        "coordinator_url": COORD,
        "chunk_size": CHUNK,
        "salt": "shared",
        "salt_prefix": "run7",
        "fleet_pin_budget_tokens": 40,
    }
    config = AgentKVConfig.model_validate({"engine": engine, "policy": "full"})
    backend = EngineBackend(tiny_tokenizer, config, bytes_per_token=10, transport=fake_engine(sim))
    assert backend.planner is not None and backend.planner.budget_tokens == 40
    for name in ("a", "b", "c"):
        session = backend.session(name)
        assert session.cache_salt == "run7" and session.store.owner == name
        history = [
            {"role": "system", "content": f"You are assistant {name}. Answer in one short line. " * 3},
            {"role": "user", "content": "Where is my train?"},
        ]
        session.extend(history)
        session.generate(2)
        session.apply(TurnEnded())  # the turn's spans are committed: the next call pins them
        session.extend(
            [*history, {"role": "assistant", "content": " ok"}, {"role": "user", "content": "Ok."}]
        )
        session.generate(2)
    shares = backend.planner.shares()
    assert list(shares) == ["a", "b", "c"]  # the order in which they first asked
    assert sum(shares.values()) <= 40 and shares["a"] > 0
    assert len(sim.pins) <= 40 // CHUNK  # the coordinator's pin table holds the fleet budget at most
    for name in ("a", "b", "c"):
        backend.close(name)
    assert sim.pins == {} and backend.planner.shares() == {}


def test_engine_block_validates_the_fleet_budget_and_the_salt_prefix() -> None:
    from agentkv import AgentKVConfig

    base = {"vllm_url": "http://v:8000"}
    assert AgentKVConfig.model_validate({"engine": base}).engine.fleet_pin_budget_tokens is None  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="fleet_pin_budget_tokens"):
        AgentKVConfig.model_validate({"engine": {**base, "fleet_pin_budget_tokens": -64}})
    with pytest.raises(ValueError, match="salt_prefix"):
        AgentKVConfig.model_validate({"engine": {**base, "salt_prefix": "tenant/a"}})
    with pytest.raises(ValueError, match="salt_prefix"):
        AgentKVConfig.model_validate({"engine": {**base, "salt_prefix": "x" * 65}})
