"""A fleet of engines over one LMCache: sticky routing, least-loaded placement, failover, return.

Several simulated vLLM servers (told apart by host) share one simulated LMCache
(`SimLMCache`): an engine can be stopped (connection refused), made to time out, and
started again, so routing and failover are checked without a stack.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from agentkv import AgentKVConfig, SessionClosed, TurnEnded
from agentkv.engines import EngineBackend, EngineFleet, EngineLoad
from agentkv.engines.http import EngineUnavailableError, Response
from agentkv.engines.vllm import VLLMClient
from agentkv.spans import SpanState
from tests.unit.test_engine_store import CHUNK, COORD, SimLMCache, fake_engine

URLS = ["http://v0:8000", "http://v1:8000"]
HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a rail assistant. " * 4},
    {"role": "user", "content": "Zurich to Vienna tonight?"},
]


class FleetTransport:
    """vLLM servers by host over one simulated LMCache: each can be stopped or made to time out."""

    def __init__(self, sim: SimLMCache) -> None:
        self.sim = sim
        self.inner = fake_engine(sim)
        self.inner.routes["GET /health"] = {}
        self.stopped: set[str] = set()
        self.slow: set[str] = set()
        self.served: list[str] = []
        """The host of every completion answered, in order."""

    def request(self, method: str, url: str, body: Any | None, timeout: float) -> Response:
        host = url.split("://", 1)[1].split("/", 1)[0]
        if host in self.stopped:
            msg = f"{method} {url}: no answer within {timeout:g} s (connection refused)"
            raise EngineUnavailableError(msg, refused=True)
        if host in self.slow:
            msg = f"{method} {url}: no answer within {timeout:g} s (timed out)"
            raise EngineUnavailableError(msg)
        if url.endswith("/v1/completions"):
            self.served.append(host)
        return self.inner.request(method, url, body, timeout)

    def completions(self, host: str) -> list[Any]:
        """Prompts engine `host` answered (the recorded requests that it served)."""
        bodies = self.inner.sent("POST", "/v1/completions")
        return [b for b, h in zip(bodies, self.served, strict=False) if h == host]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def sim() -> SimLMCache:
    return SimLMCache()


def make_fleet(
    sim: SimLMCache, tokenizer: Any, urls: list[str] | None = None, **engine: Any
) -> tuple[EngineBackend, FleetTransport, Clock]:
    transport = FleetTransport(sim)
    settings = {"vllm_url": urls or URLS, "coordinator_url": COORD, "chunk_size": CHUNK, **engine}
    config = AgentKVConfig.model_validate({"engine": settings})
    backend = EngineBackend(tokenizer, config, bytes_per_token=10, transport=transport)
    clock = Clock()
    backend.fleet.clock = clock
    return backend, transport, clock


_HISTORIES: dict[tuple[int, str], list[dict[str, Any]]] = {}


def talk(backend: EngineBackend, thread: str, turns: int = 1) -> Any:
    """`turns` more user turns of a thread, each answered and ended; returns the session."""
    session = backend.session(thread)
    history = _HISTORIES.setdefault((id(backend), thread), [])
    for _ in range(turns):
        if not history:
            history.extend(HISTORY)
        else:
            history.append({"role": "user", "content": f"And the return trip, day {len(history)}?"})
        session.extend(history)
        history.append({"role": "assistant", "content": session.generate(4)})
        session.apply(TurnEnded())
    return session


# -- configuration -------------------------------------------------------------------------------


def test_one_url_is_a_fleet_of_one_and_a_list_a_fleet(sim: SimLMCache, tiny_tokenizer: Any) -> None:
    one = AgentKVConfig.model_validate({"engine": {"vllm_url": "http://v0:8000"}})
    assert one.engine is not None and one.engine.urls == ("http://v0:8000",)
    backend, _, _ = make_fleet(sim, tiny_tokenizer)
    assert [e.url for e in backend.fleet.engines] == URLS and backend.vllm.url == URLS[0]
    by_argument = EngineBackend(tiny_tokenizer, one, bytes_per_token=10, vllm_urls=URLS)
    assert by_argument.engine.urls == tuple(URLS) and len(by_argument.fleet) == 2
    for bad, problem in (
        ([], "a list of distinct URLs"),
        ([URLS[0], URLS[0]], "a list of distinct URLs"),
        ([URLS[0], "v1:8000"], "expected an http:// or https:// URL, got 'v1:8000'"),
    ):
        with pytest.raises(ValueError, match=problem):
            AgentKVConfig.model_validate({"engine": {"vllm_url": bad}})


# -- routing -------------------------------------------------------------------------------------


def test_new_threads_spread_and_each_thread_sticks_to_its_engine(
    sim: SimLMCache, tiny_tokenizer: Any
) -> None:
    backend, transport, _ = make_fleet(sim, tiny_tokenizer)
    first = talk(backend, "t1")
    second = talk(backend, "t2")
    assert first.engine_index == 0 and second.engine_index == 1
    assert second.last_route is not None and second.last_route.reason == "least-loaded"
    talk(backend, "t1", turns=2)
    stats = first.stats()
    assert stats.engine == URLS[0] and stats.route.startswith("sticky")
    assert transport.served == ["v0:8000", "v1:8000", "v0:8000", "v0:8000"]
    assert stats.engine_moves == 0 and backend.fleet.stats.failovers == 0


def test_a_new_thread_goes_where_the_working_sets_are_smallest(sim: SimLMCache, tiny_tokenizer: Any) -> None:
    backend, _, _ = make_fleet(sim, tiny_tokenizer)
    talk(backend, "long", turns=4)  # engine 0: one long conversation
    talk(backend, "short")  # engine 1 (least loaded)
    talk(backend, "short-2")  # engine 1 again: two short ones hold fewer tokens than the long one
    loads = backend.engine_loads()
    assert loads[0].sessions == 1 and loads[1].sessions == 2 and loads[1].tokens < loads[0].tokens
    assert backend.get("short-2").engine_index == 1
    route = backend.get("short-2").stats().route
    assert route.startswith("least-loaded") and "engine 0: 0 in flight" in route


def test_the_admission_gates_working_sets_are_the_load(sim: SimLMCache, tiny_tokenizer: Any) -> None:
    backend, _, _ = make_fleet(sim, tiny_tokenizer, admission_tokens=100_000)
    talk(backend, "t1")
    assert backend.gate is not None
    held = backend.gate.working_set("t1")
    assert held is not None and held > 0
    assert backend.engine_loads()[0] == EngineLoad(calls=0, tokens=held, sessions=1)


def test_route_orders_by_calls_then_tokens_then_conversations() -> None:
    fleet = EngineFleet([VLLMClient(u, "m") for u in URLS])
    busy, idle = EngineLoad(2, 0, 0), EngineLoad(0, 5000, 9)
    assert fleet.route(None, [busy, idle]).engine == 1
    assert fleet.route(None, [EngineLoad(0, 10, 0), EngineLoad(0, 9, 5)]).engine == 1
    assert fleet.route(None, [EngineLoad(0, 9, 2), EngineLoad(0, 9, 1)]).engine == 1
    tie = [EngineLoad(0, 0, 0), EngineLoad(0, 0, 0)]
    assert fleet.route(None, tie).engine == 0 and fleet.route(None, tie, near=1).engine == 1
    assert fleet.route(None, tie, near=1).reason == "branch"
    with pytest.raises(ValueError, match="expected one per engine"):
        fleet.route(None, [busy])


def test_a_branch_may_go_to_another_engine_and_starts_from_the_shared_store(
    sim: SimLMCache, tiny_tokenizer: Any
) -> None:
    backend, transport, _ = make_fleet(sim, tiny_tokenizer)
    thread = talk(backend, "t1")
    branch = thread.fork("b1")
    branch.extend(
        [*HISTORY, {"role": "assistant", "content": " ok"}, {"role": "user", "content": "Option B?"}]
    )
    branch.generate(4)
    assert thread.engine_index == 0 and branch.engine_index == 1
    assert branch.last_route is not None and branch.last_route.reason == "branch"
    assert branch.cache_salt == thread.cache_salt  # one salt: engine 1 reads the parent's chunks
    prompt = transport.completions("v1:8000")[-1]["prompt"]
    assert prompt[: len(thread.engine_sequence) - 2] == thread.engine_sequence[:-2]


def test_a_branch_on_another_engine_is_adopted_there_without_losing_its_prefix(
    sim: SimLMCache, tiny_tokenizer: Any
) -> None:
    backend, transport, _ = make_fleet(sim, tiny_tokenizer)
    thread = talk(backend, "t1")
    salt = thread.cache_salt
    asked = [*HISTORY, {"role": "assistant", "content": " ok"}, {"role": "user", "content": "Option B?"}]
    loser, winner = thread.fork("a"), thread.fork("b")
    loser.extend([*asked[:-1], {"role": "user", "content": "Option A, the night train?"}])
    loser.generate(4)  # engine 1 (least loaded)
    winner.extend(asked)
    winner.generate(4)  # engine 0 is the least loaded now (ties: the parent's)
    assert {loser.engine_index, winner.engine_index} == {0, 1}
    went_on = list(winner.store.sent)
    adopted = backend.adopt("t1", "b")
    assert adopted is winner and backend.get("t1") is winner and loser.closed and thread.closed
    assert winner.parent is None and winner.session_id == "t1" and winner.stats().route.startswith("adopted")
    # The old thread's close spared the chunks the adopted branch goes on with.
    assert all(sim.held(went_on, salt)[: len(went_on) // CHUNK])
    engine = winner.engine_index
    winner.extend([*asked, {"role": "assistant", "content": " ok"}, {"role": "user", "content": "Book it."}])
    reused = winner.counters.reused_tokens
    winner.generate(4)
    assert winner.engine_index == engine and winner.stats().route.startswith("sticky")
    assert winner.counters.reused_tokens - reused == len(went_on) // CHUNK * CHUNK
    backend.close("t1")
    assert sim.pins == {} and not any(any(t) for t in sim.held(went_on, salt))


# -- failover ------------------------------------------------------------------------------------


def test_a_stopped_engines_threads_move_and_their_history_comes_back_from_lmcache(
    sim: SimLMCache, tiny_tokenizer: Any
) -> None:
    backend, transport, _ = make_fleet(sim, tiny_tokenizer)
    first = talk(backend, "t1")
    talk(backend, "t2")
    transport.stopped.add("v0:8000")  # engine 0 dies between turns
    before = len(sim.prefetched)
    reused, sequence = first.counters.reused_tokens, len(first.engine_sequence)
    moved = talk(backend, "t1")  # no call fails
    assert moved is first and first.engine_index == 1
    stats = first.stats()
    assert stats.engine == URLS[1] and stats.engine_moves == 1
    assert stats.route.startswith("failover: engine 0 down (POST http://v0:8000/v1/completions")
    assert backend.fleet.stats.marked_down == 1 and backend.fleet.stats.failovers == 1
    assert backend.fleet.up() == [1] and first.store.stats.moves == 1
    # The moved thread's prompt was prefetched into the shared LMCache before its call there,
    # and engine 1 read the history from it: every whole chunk of the previous call's sequence.
    assert sim.prefetched[before:][-1] == transport.completions("v1:8000")[-1]["prompt"]
    assert first.counters.reused_tokens - reused == sequence // CHUNK * CHUNK
    talk(backend, "t1")
    assert first.stats().route.startswith("sticky") and first.stats().engine_moves == 1
    # Its pins are the coordinator's (one shared store): close gives every one back.
    assert any(sim.pins.values())
    backend.close("t1")
    backend.close("t2")
    assert sim.pins == {}


def test_timeouts_mark_an_engine_down_after_the_limit_and_no_call_fails(
    sim: SimLMCache, tiny_tokenizer: Any
) -> None:
    backend, transport, _ = make_fleet(sim, tiny_tokenizer, down_after_failures=2)
    talk(backend, "t1")
    talk(backend, "t2")
    transport.slow.add("v0:8000")
    talk(backend, "t1", turns=2)  # timed out on engine 0, answered by engine 1
    assert backend.fleet.engines[0].up and backend.fleet.engines[0].failures == 1
    assert backend.fleet.stats.failovers == 1 and backend.get("t1").engine_index == 1
    talk(backend, "t3")  # a new thread tries engine 0 (least loaded): a second timeout marks it down
    assert not backend.fleet.engines[0].up and backend.get("t3").engine_index == 1
    assert backend.fleet.stats.failovers == 2


def test_a_returned_engine_is_used_again_after_its_health_check(sim: SimLMCache, tiny_tokenizer: Any) -> None:
    backend, transport, clock = make_fleet(sim, tiny_tokenizer, health_interval_s=5.0)
    talk(backend, "t1")
    transport.stopped.add("v0:8000")
    talk(backend, "t1", turns=2)
    assert backend.fleet.up() == [1]
    transport.stopped.discard("v0:8000")  # restarted
    talk(backend, "t2")  # checked less than health_interval_s ago: still down
    assert backend.get("t2").engine_index == 1
    clock.now += 5.0
    talk(backend, "t3")  # the health check finds it back: the least-loaded engine again
    assert backend.fleet.up() == [0, 1] and backend.fleet.stats.came_back == 1
    assert backend.get("t3").engine_index == 0
    assert backend.get("t1").engine_index == 1  # a moved thread stays where its cache is warm


def test_a_failing_health_check_marks_an_engine_down_before_any_call_fails(
    sim: SimLMCache, tiny_tokenizer: Any
) -> None:
    backend, transport, clock = make_fleet(sim, tiny_tokenizer)
    talk(backend, "t1")
    transport.stopped.add("v0:8000")
    clock.now += 10.0
    talk(backend, "t2")
    assert backend.fleet.up() == [1] and backend.fleet.stats.failovers == 0
    assert backend.fleet.stats.health_checks >= 2


def test_every_engine_down_fails_the_call_with_each_engines_error(
    sim: SimLMCache, tiny_tokenizer: Any
) -> None:
    backend, transport, _ = make_fleet(sim, tiny_tokenizer)
    talk(backend, "t1")
    transport.stopped.update({"v0:8000", "v1:8000"})
    session = backend.get("t1")
    session.extend([*HISTORY, {"role": "assistant", "content": " ok"}, {"role": "user", "content": "Price?"}])
    spans = len(session.spans)
    with pytest.raises(EngineUnavailableError, match="connection refused"):
        session.generate(4)
    assert len(session.spans) == spans  # the answer span that had no answer is gone
    transport.stopped.clear()
    assert session.generate(4) == " ok"  # down engines are tried when nothing is up


def test_one_engine_behaves_as_without_a_fleet(sim: SimLMCache, tiny_tokenizer: Any) -> None:
    backend, transport, _ = make_fleet(sim, tiny_tokenizer, urls=[URLS[0]])
    session = talk(backend, "t1")
    assert session.stats().route.startswith("least-loaded")
    talk(backend, "t1", turns=2)
    transport.stopped.add("v0:8000")
    session.extend([*HISTORY, {"role": "user", "content": "Price?"}])
    with pytest.raises(EngineUnavailableError, match="connection refused"):
        session.generate(4)
    assert not transport.inner.sent("GET", "/health")  # a fleet of one sends no health checks


# -- a conversation that goes on after SessionClosed; per-session settings -----------------------


def test_after_session_closed_the_released_history_is_in_the_prompt_again(
    sim: SimLMCache, tiny_tokenizer: Any
) -> None:
    backend, transport, _ = make_fleet(sim, tiny_tokenizer, urls=[URLS[0]])
    session = talk(backend, "t1")
    full = session.store.prompt()
    session.apply(SessionClosed())
    assert all(
        s.state in (SpanState.ARCHIVED, SpanState.EVICTED, SpanState.EVICTABLE) or s.pinned
        for s in session.spans
    )
    history = [*HISTORY, {"role": "assistant", "content": " ok"}, {"role": "user", "content": "One more?"}]
    session.extend(history)
    session.generate(4)
    prompt = transport.completions("v0:8000")[-1]["prompt"]
    assert prompt[: len(full)] == full  # every span it released is sent again
    assert not session.ended


def test_session_settings_the_engine_backend_owns_are_warned_and_prefix_sharing_is_applied(
    sim: SimLMCache, tiny_tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    backend, _, _ = make_fleet(sim, tiny_tokenizer, salt="shared", salt_prefix="fleet")
    shared = backend.session("t1")
    own = backend.config.with_overrides({"prefix_cache": {"enabled": False, "max_tokens": 64}})
    with caplog.at_level(logging.WARNING, logger="agentkv.engines"):
        alone = backend.session("t2", config=own)
        backend.session("t3", config=own)
    assert shared.cache_salt == "fleet" and alone.cache_salt == "fleett2"
    warnings = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(warnings) == 1 and "agentkv.prefix_cache.max_tokens" in warnings[0]
    assert "prefix_cache.enabled" not in warnings[0]


def test_threads_that_start_together_spread_over_the_engines(sim: SimLMCache, tiny_tokenizer: Any) -> None:
    import threading

    backend, _, _ = make_fleet(sim, tiny_tokenizer)
    sessions = [backend.session(f"t{i}") for i in range(4)]
    for session in sessions:
        session.extend(HISTORY)
    start = threading.Barrier(len(sessions))

    def first_call(session: Any) -> None:
        start.wait()
        session.generate(4)

    workers = [threading.Thread(target=first_call, args=(s,)) for s in sessions]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert sorted(s.engine_index for s in sessions) == [0, 0, 1, 1]


def test_the_fleet_bench_finds_engine_i_at_port_plus_i_and_checks_its_settings() -> None:
    from agentkv_bench.engine import EngineBenchSettings
    from agentkv_bench.engine_fleet import FleetBenchSettings, engine_urls

    assert engine_urls("http://127.0.0.1:28000", 3) == [f"http://127.0.0.1:{28000 + i}" for i in range(3)]
    with pytest.raises(ValueError, match="expected a URL with a host and a port"):
        engine_urls("http://127.0.0.1", 2)
    base = EngineBenchSettings(vllm_url="http://127.0.0.1:28000", coordinator_url=COORD)
    with pytest.raises(ValueError, match="engines: expected >= 2"):
        FleetBenchSettings(base=base, engines=1)
    with pytest.raises(ValueError, match="kill_after: expected >= 1"):
        FleetBenchSettings(base=base, kill_after=0)
