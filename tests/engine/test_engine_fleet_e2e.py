"""A fleet on the real stack: two vLLM-CPU servers over one LMCache, one of them stopped mid-run.

Two LangGraph tool agents (`agentkv_langgraph.demo_agent`, `ChatAgentKV` on an
`EngineBackend` over both engines) land on the two engines; engine 1 is stopped between
turns; both agents go on answering on engine 0, and the moved thread's first call there
reads most of its prompt from LMCache (its history was never in engine 0's memory).
After close, nothing of the two conversations is left on LMCache; engine 1, started
again, is picked up by the fleet's health check and serves a new thread.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from agentkv.engines.lmcache import CoordinatorClient
from agentkv.engines.vllm import VLLMClient
from tests.engine.test_engine_repair_e2e import salt_keys, wait_for

EngineStack = Any  # tests/engine/conftest.py: the running stack's URLs and facts


def fleet_config(stack: EngineStack) -> Any:
    from agentkv import AgentKVConfig

    engine = {
        "vllm_url": list(stack.vllm_urls),
        "coordinator_url": stack.coordinator_url,
        "model_path": stack.model_path,
        "chunk_size": stack.chunk_size,
        "request_timeout_s": 600.0,
        "prefetch_wait_s": 10.0,
        "health_interval_s": 2.0,
    }
    return AgentKVConfig.model_validate({"engine": engine})


def first_answer(messages: list[Any], before: int) -> Any:
    """The first model message of a turn."""
    from langchain_core.messages import AIMessage

    return next(m for m in messages[before:] if isinstance(m, AIMessage))


def usage_recorder() -> Any:
    """A callback handler that keeps the `usage_metadata` of every model call, in order.

    The graph may replace a forced tool call whose arguments did not parse by one of its
    own (without usage): the call's usage is read where the model answered.
    """
    from langchain_core.callbacks import BaseCallbackHandler

    class Usages(BaseCallbackHandler):
        def __init__(self) -> None:
            self.usages: list[dict[str, Any]] = []

        def on_llm_end(self, response: Any, **kwargs: Any) -> None:
            message = getattr(response.generations[0][0], "message", None)
            if message is not None and message.usage_metadata is not None:
                self.usages.append(dict(message.usage_metadata))

    return Usages()


@pytest.mark.engine
def test_two_agents_go_on_when_one_engine_dies_and_its_thread_reads_lmcache(
    engine_stack: EngineStack,
) -> None:
    from agentkv.engines import EngineBackend
    from agentkv_langchain import ChatAgentKV
    from agentkv_langgraph import with_kv_lifecycle
    from agentkv_langgraph.demo_agent import build_graph, turn_input

    stack = engine_stack
    if len(stack.vllm_urls) < 2:
        pytest.skip("the fleet test needs two engines (AGENTKV_ENGINE_VLLM_URLS names one)")
    backend = EngineBackend.from_config(fleet_config(stack))
    graph = with_kv_lifecycle(build_graph(ChatAgentKV(backend=backend, max_new_tokens=12)), backend=backend)
    nonce = time.time_ns()
    threads = [f"fleet-a-{nonce}", f"fleet-b-{nonce}"]

    recorder = usage_recorder()

    def turn(thread: str, index: int) -> tuple[list[Any], int]:
        config = {"configurable": {"thread_id": thread}}
        before = len(graph.get_state(config).values.get("messages", []))
        out = graph.invoke(turn_input(index), {**config, "callbacks": [recorder]})
        return out["messages"], before

    for index in range(2):
        for thread in threads:
            messages, before = turn(thread, index)
            assert first_answer(messages, before) is not None
    placed = {thread: backend.get(thread).engine_index for thread in threads}
    assert sorted(placed.values()) == [0, 1], placed  # one agent per engine
    moved = next(t for t, engine in placed.items() if engine == 1)
    salts = [backend.get(t).cache_salt for t in threads]

    stack.stop_engine(1)  # between turns: engine 1's process group ends
    engine0 = VLLMClient(stack.vllm_urls[0], stack.served_name, timeout=600)
    metrics_before = engine0.metrics()
    calls_before = len(recorder.usages)
    messages, before = turn(moved, 2)  # the moved thread's next turn: no call fails
    assert first_answer(messages, before) is not None
    usage = recorder.usages[calls_before]  # its first call after the kill
    cached, prompt = usage["input_token_details"]["cache_read"], usage["input_tokens"]
    # Engine 0 never computed this conversation: what it did not compute came from LMCache.
    assert cached >= 0.8 * prompt, (cached, prompt)
    assert engine0.metrics().minus(metrics_before).external_hits >= cached - stack.chunk_size
    session = backend.get(moved)
    stats = session.stats()
    assert session.engine_index == 0 and stats.engine_moves == 1 and stats.engine == stack.vllm_urls[0]
    assert backend.fleet.up() == [0] and backend.fleet.stats.marked_down == 1
    other = next(t for t in threads if t != moved)
    messages, before = turn(other, 2)
    assert first_answer(messages, before).content is not None
    assert backend.fleet.stats.failovers <= 1  # at most the call that found engine 1 gone

    stack.start_engine(1)  # the dead engine comes back: the health check picks it up
    assert wait_for(lambda: (backend.fleet.check_health(force=True), backend.fleet.up())[1] == [0, 1], 60)
    fresh = backend.session(f"fleet-c-{nonce}")
    fresh.extend([{"role": "user", "content": "Say hello."}])
    fresh.generate(4)
    assert fresh.engine_index == 1 and fresh.stats().route.startswith("least-loaded")

    coordinator = CoordinatorClient(stack.coordinator_url, stack.model_path, timeout=30)
    for thread in [*threads, fresh.session_id]:
        backend.close(thread)
    for salt in salts:
        assert coordinator.pins(salt) == 0
        assert wait_for(lambda s=salt: salt_keys(stack.coordinator_url, s) == 0, 30), (
            salt,
            salt_keys(stack.coordinator_url, salt),
        )
