"""`AdmissionGate`: which conversations may call the engine while its cache cannot hold them all.

The gate alone (order, capacity, oversized conversations, timeouts, TTLs, release), then
inside `EngineBackend` sessions over the fake vLLM and the simulated LMCache of
`test_engine_store.py`. Waits are observed through the gate's state, never timed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from agentkv.engines.admission import Admission, AdmissionGate
from agentkv.engines.planner import EnginePinPlanner
from tests.unit.test_engine_store import CHUNK, COORD, SimLMCache, fake_engine


def _until(condition: Callable[[], bool], what: str) -> None:
    """Wait for another thread to reach a state (generous bound: a loaded CI machine)."""
    deadline = time.monotonic() + 30
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"never reached: {what}")
        time.sleep(0.005)


class _Caller:
    """`acquire` on a thread of its own; `admission` is its answer once it returns."""

    def __init__(self, gate: AdmissionGate, owner: str, tokens: int) -> None:
        self.admission: Admission | None = None
        self.thread = threading.Thread(target=self._run, args=(gate, owner, tokens), daemon=True)
        self.thread.start()

    def _run(self, gate: AdmissionGate, owner: str, tokens: int) -> None:
        self.admission = gate.acquire(owner, tokens)

    def result(self) -> Admission:
        self.thread.join(timeout=30)
        assert self.admission is not None, "acquire never returned"
        return self.admission


def test_admits_in_order_of_arrival_while_the_working_sets_fit() -> None:
    gate = AdmissionGate(100, quantum_turns=1)
    assert gate.acquire("a", 40).outcome == "admitted"
    assert gate.acquire("b", 40).outcome == "admitted"
    c = _Caller(gate, "c", 40)
    _until(lambda: gate.waiting() == ["c"], "c in line")
    d = _Caller(gate, "d", 10)  # d would fit now, but c came first: strict FIFO, no overtaking
    _until(lambda: gate.waiting() == ["c", "d"], "d in line behind c")
    assert gate.residents() == ["a", "b"]
    gate.call_done("a", 40)
    assert gate.turn_ended("a", 40) is False  # others wait and a had its quantum: it yields
    assert c.result().outcome == "admitted" and c.result().resident
    assert d.result().outcome == "admitted"
    assert gate.residents() == ["b", "c", "d"] and gate.resident_tokens() == 90
    assert gate.acquire("b", 40).outcome == "resident"  # a resident never waits
    assert gate.stats.waits == 2 and gate.stats.yielded_quantum == 1


def test_a_resident_keeps_its_place_while_nobody_waits_and_within_its_quantum() -> None:
    gate = AdmissionGate(100, quantum_turns=2)
    gate.acquire("a", 50)
    gate.call_done("a", 50)
    assert gate.turn_ended("a", 50) is True  # nobody waits
    gate.acquire("b", 50)
    gate.call_done("b", 50)
    c = _Caller(gate, "c", 50)
    _until(lambda: gate.waiting() == ["c"], "c in line")
    assert gate.turn_ended("b", 50) is True  # b has had 1 of its 2 turns
    assert gate.turn_ended("a", 50) is False  # a has had 2: its place goes to c
    assert c.result().outcome == "admitted"
    assert gate.residents() == ["b", "c"]


def test_capacity_is_respected_under_concurrent_agents() -> None:
    observed: list[tuple[int, int]] = []
    gate = AdmissionGate(100, quantum_turns=1)
    gate.on_change = lambda order, _: observed.append((gate.resident_tokens(), len(gate.residents())))
    sizes = {f"c{i}": 20 + 10 * (i % 4) for i in range(8)}

    def agent(owner: str) -> None:
        for _ in range(5):
            admission = gate.acquire(owner, sizes[owner])
            assert admission.resident
            gate.call_done(owner, sizes[owner])
            gate.turn_ended(owner, sizes[owner])
        gate.release(owner)

    threads = [threading.Thread(target=agent, args=(owner,)) for owner in sizes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "an agent never finished (deadlock)"
    assert observed and all(used <= 100 for used, _ in observed)
    assert gate.residents() == [] and gate.waiting() == []
    assert gate.stats.timeouts == 0 and gate.stats.admitted >= len(sizes)


def test_an_oversized_conversation_runs_alone_and_nothing_deadlocks() -> None:
    gate = AdmissionGate(100, quantum_turns=1)
    gate.acquire("a", 30)
    big = _Caller(gate, "big", 500)
    _until(lambda: gate.waiting() == ["big"], "big in line")
    small = _Caller(gate, "small", 10)
    _until(lambda: gate.waiting() == ["big", "small"], "small behind big")
    gate.call_done("a", 30)
    assert gate.turn_ended("a", 30) is False
    assert big.result().outcome == "alone"
    assert gate.residents() == ["big"] and gate.stats.admitted_alone == 1
    gate.call_done("big", 520)
    gate.release("big")  # closed: the next one moves in
    assert small.result().outcome == "admitted"
    assert gate.residents() == ["small"]


def test_residents_that_outgrew_the_capacity_shed_the_youngest_at_its_turn_end() -> None:
    gate = AdmissionGate(100, quantum_turns=10, wait_s=0.05)
    for owner in ("a", "b", "c"):
        gate.acquire(owner, 30)
        gate.call_done(owner, 30)
    assert gate.turn_ended("a", 45) is True  # 45 + 30 + 30 > 100, but a is not the youngest
    assert gate.turn_ended("c", 45) is False  # c is: it gives its place up
    assert gate.residents() == ["a", "b"] and gate.stats.shed == 1
    assert gate.acquire("c", 45).outcome == "timeout"  # 45 + 30 + 45 > 100: it waits its turn
    assert gate.waiting() == ["c"]


def test_a_wait_is_bounded_then_the_call_proceeds_unadmitted_and_keeps_its_place() -> None:
    gate = AdmissionGate(100, wait_s=0.05)
    gate.acquire("a", 90)
    late = gate.acquire("b", 20)
    assert late.outcome == "timeout" and not late.resident
    assert gate.stats.timeouts == 1 and gate.waiting() == ["b"]
    gate.turn_ended("b", 20)  # a conversation that is not resident has no place to give up
    gate.release("a")
    assert gate.residents() == ["b"]  # its place in line came up while it was away
    assert gate.acquire("b", 20).outcome == "resident"


def test_idle_residents_lose_their_place_to_waiters_after_their_ttl_never_during_a_call() -> None:
    now = [0.0]
    gate = AdmissionGate(100, wait_s=0.05, tool_ttl_s=60.0, park_ttl_s=5.0, clock=lambda: now[0])
    gate.acquire("calling", 60)  # a model call in flight: never revoked
    now[0] = 1_000.0
    assert gate.acquire("b", 60).outcome == "timeout"
    gate.call_done("calling", 60)  # between the calls of a turn (tools): the tool TTL applies
    now[0] += 30.0
    assert gate.acquire("b", 60).outcome == "timeout"
    now[0] += 31.0
    assert gate.acquire("b", 60).outcome == "admitted"  # the stalled one lost its place to b
    assert gate.residents() == ["b"] and gate.stats.revoked_idle == 1
    gate.call_done("b", 60)
    assert gate.turn_ended("b", 60) is True  # parked: the park TTL applies
    now[0] += 6.0
    assert gate.acquire("c", 60).outcome == "admitted"
    assert gate.residents() == ["c"] and gate.stats.revoked_idle == 2


def test_release_frees_residents_and_waiters_and_ignores_unknown_owners() -> None:
    order: list[list[str]] = []
    gate = AdmissionGate(100, wait_s=0.05, on_change=lambda o, _: order.append(list(o)))
    gate.acquire("a", 70)
    gate.acquire("b", 70)  # times out, stays in line
    gate.release("nobody")
    gate.release("b")
    assert gate.waiting() == [] and gate.residents() == ["a"]
    gate.release("a")
    assert gate.residents() == [] and order[-1] == []


def test_invalid_arguments_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="capacity_tokens: expected an int > 0, got 0"):
        AdmissionGate(0)
    with pytest.raises(ValueError, match="quantum_turns: expected an int > 0, got -1"):
        AdmissionGate(10, quantum_turns=-1)
    with pytest.raises(ValueError, match="wait_s: expected a number > 0, got 0"):
        AdmissionGate(10, wait_s=0)
    with pytest.raises(ValueError, match="working_set_tokens: expected an int >= 0, got -3"):
        AdmissionGate(10).acquire("a", -3)


def test_the_planner_grants_pins_to_residents_first_then_the_line() -> None:
    planner = EnginePinPlanner(budget_tokens=100, chunk_size=10)
    for owner in "abc":
        planner.grant(owner, 60)
    assert planner.shares() == {"a": 60, "b": 40, "c": 0}
    planner.prioritize(["c", "b"])  # the gate's order: c and b resident, a waits
    assert planner.shares() == {"c": 60, "b": 40, "a": 0}
    planner.prioritize(["d", "c"])  # an owner not known yet takes its place, wanting nothing
    assert planner.shares() == {"d": 0, "c": 60, "b": 40, "a": 0}
    planner.prioritize(["d", "c"], reserve={"d": 30})  # a resident's working set is reserved
    assert planner.shares() == {"d": 30, "c": 60, "b": 10, "a": 0}


# -- in the engine backend ------------------------------------------------------------------------


@pytest.fixture
def sim() -> SimLMCache:
    return SimLMCache()


def _gated_backend(sim: SimLMCache, tokenizer: Any, **engine: Any) -> Any:
    from agentkv import AgentKVConfig
    from agentkv.engines import EngineBackend

    base = {"vllm_url": "http://v:8000", "coordinator_url": COORD, "chunk_size": CHUNK}
    config = AgentKVConfig.model_validate({"engine": {**base, **engine}, "policy": "full"})
    return EngineBackend(tokenizer, config, bytes_per_token=10, transport=fake_engine(sim))


def _history(name: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": f"You are assistant {name}. Answer in one short line. " * 3},
        {"role": "user", "content": "Where is my train?"},
    ]


def test_sessions_call_only_while_resident_and_close_gives_the_place_back(
    sim: SimLMCache, tiny_tokenizer: Any
) -> None:
    from agentkv import TurnEnded

    backend = _gated_backend(sim, tiny_tokenizer, admission_tokens=10_000, fleet_pin_budget_tokens=40)
    a = backend.session("a")
    a.extend(_history("a"))
    a.generate(2)
    assert a.last_admission is not None and a.last_admission.outcome == "admitted"
    assert backend.gate.residents() == ["a"]
    a.apply(TurnEnded())  # nobody waits: a stays resident and is not parked (it calls again soon)
    assert backend.gate.residents() == ["a"]
    assert a.store.stats.demoted_chunks == 0 and not [w for w, _ in a.store.stats.log if w == "demote"]
    a.extend([*_history("a"), {"role": "assistant", "content": " ok"}, {"role": "user", "content": "Ok."}])
    a.generate(2)
    assert a.last_admission is not None and a.last_admission.outcome == "resident"
    assert list(backend.planner.shares()) == ["a"]
    backend.close("a")
    assert backend.gate.residents() == [] and sim.pins == {}


def test_a_session_that_gives_its_place_up_is_parked_and_its_pin_shrinks(
    sim: SimLMCache, tiny_tokenizer: Any
) -> None:
    from agentkv import TurnEnded

    backend = _gated_backend(
        sim, tiny_tokenizer, admission_tokens=1, admission_quantum_turns=1, fleet_pin_budget_tokens=40
    )
    a = backend.session("a")
    history = _history("a")
    a.extend(history)
    a.generate(2)  # alone: its working set exceeds the capacity
    assert a.last_admission is not None and a.last_admission.outcome == "alone"
    a.apply(TurnEnded())
    follow_up = [*history, {"role": "assistant", "content": " ok"}, {"role": "user", "content": "Ok."}]
    a.extend(follow_up)
    a.generate(2)  # now its committed history is pinned
    assert len(sim.pins) == 40 // CHUNK  # a pins its whole share of the fleet budget
    b = backend.session("b")
    b.extend(_history("b"))
    waiting = threading.Thread(target=b.generate, args=(2,), daemon=True)
    waiting.start()
    _until(lambda: backend.gate.waiting() == ["b"], "b waits for a's place")
    a.apply(TurnEnded())  # b waits and a had its quantum: a yields, its pin goes, it is parked
    waiting.join(timeout=30)
    assert not waiting.is_alive()
    assert b.last_admission is not None and b.last_admission.outcome == "alone"
    assert backend.gate.residents() == ["b"]
    assert backend.planner.shares() == {"b": 40, "a": 0}  # b's working set is reserved first
    b_keys = sim.keys(b.store.prompt()[:40], b.cache_salt)
    assert set(sim.pins) == set(b_keys) and a.store.stats.unpins >= 1  # a gave its pin up at once
    assert a.store.stats.demoted_chunks == 0  # parked: what it kept on L2 (nothing now) left L1
    for name in ("a", "b"):
        backend.close(name)
    assert sim.pins == {} and backend.gate.residents() == []


def test_without_admission_tokens_there_is_no_gate_and_sessions_park_as_before(
    sim: SimLMCache, tiny_tokenizer: Any
) -> None:
    backend = _gated_backend(sim, tiny_tokenizer)
    assert backend.gate is None
    session = backend.session("a")
    session.extend(_history("a"))
    session.generate(2)
    assert session.last_admission is None


def test_engine_block_validates_the_admission_fields() -> None:
    from agentkv import AgentKVConfig

    base = {"vllm_url": "http://v:8000"}
    engine = AgentKVConfig.model_validate({"engine": base}).engine
    assert engine is not None and engine.admission_tokens is None and engine.admission_quantum_turns == 4
    for name, bad in (
        ("admission_tokens", 0),
        ("admission_tokens", "lots"),
        ("admission_quantum_turns", 0),
        ("admission_wait_s", -1.0),
        ("admission_tool_ttl_s", 0.0),
        ("admission_park_ttl_s", -5.0),
    ):
        with pytest.raises(ValueError, match=name):
            AgentKVConfig.model_validate({"engine": {**base, name: bad}})
