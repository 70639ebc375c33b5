"""On the real stack: the engine backend tells the truth and leaves nothing behind.

Judged only through LMCache's coordinator (`/cache/pins`, `/directory/lookup`,
`/directory/keys`) and vLLM's usage and `/metrics`:

- a pin that times out while the coordinator stalls lands when it resumes; the
  conversation gives that reference back, sends the skipped delete again, and closes
  with 0 pins and 0 keys;
- the turn's committed history is pinned at the turn end;
- a release and an archive in one step keep the archived chunks on L2 (and `host_bytes`
  counts what L2 holds), and a recall loads them from LMCache;
- `usage_metadata` equals vLLM's own figures for the call.

A slow coordinator is a proxy in front of the real one that holds requests and forwards
them later (what a stopped coordinator's socket backlog does when it resumes).
"""

from __future__ import annotations

import http.server
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from agentkv.engines.lmcache import CoordinatorClient
from agentkv.engines.store import EngineStore, EngineTarget
from agentkv.engines.vllm import VLLMClient
from agentkv.spans import SpanKind, SpanState, Tier
from tests.engine.test_engine_e2e import SYSTEM, TOOL_CALL, TOOL_RESULT, USER, restore, spans_of, wait_for

EngineStack = Any  # tests/engine/conftest.py: the running stack's URLs and facts


class StallingProxy:
    """HTTP proxy to `upstream`; while stalled it holds each request, and forwards it on `resume`."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.running = threading.Event()
        self.running.set()
        self.held = 0
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if not proxy.running.is_set():
                    proxy.held += 1
                    proxy.running.wait()  # the client gives up meanwhile; the request still lands
                request = urllib.request.Request(
                    proxy.upstream + self.path, data=body, method=self.command, headers=dict(self.headers)
                )
                try:
                    with urllib.request.urlopen(request, timeout=60) as response:  # noqa: S310 (local)
                        status, payload = response.status, response.read()
                except urllib.error.HTTPError as e:
                    status, payload = e.code, e.read()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except OSError:
                    pass  # the client timed out and left

            do_GET = do_POST = do_PUT = do_DELETE = _forward

            def log_message(self, *args: Any) -> None:
                del args

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stall(self) -> None:
        self.running.clear()

    def resume(self) -> None:
        self.running.set()

    def close(self) -> None:
        self.resume()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def proxy(engine_stack: EngineStack) -> Iterator[StallingProxy]:
    stalling = StallingProxy(engine_stack.coordinator_url)
    try:
        yield stalling
    finally:
        stalling.close()


def salt_keys(coordinator_url: str, salt: str) -> int:
    """Keys of `salt` the coordinator's directory lists on any tier (`GET /directory/keys`)."""
    import json

    count, offset = 0, 0
    while True:
        url = f"{coordinator_url}/directory/keys?offset={offset}&limit=1000"
        with urllib.request.urlopen(url, timeout=30) as response:  # noqa: S310 (local)
            page = json.loads(response.read())
        keys = page.get("keys") or []
        count += sum(1 for k in keys if k["key"].get("cache_salt") == salt and k.get("placements"))
        offset += len(keys)
        if not keys or offset >= int(page.get("total", 0)):
            return count


def engine_config(stack: EngineStack, coordinator_url: str, **extra: Any) -> Any:
    from agentkv import AgentKVConfig

    engine = {
        "vllm_url": stack.vllm_url,
        "coordinator_url": coordinator_url,
        "model_path": stack.model_path,
        "chunk_size": stack.chunk_size,
        "hint_timeout_s": 1.0,
        "request_timeout_s": 600.0,
        "prefetch_wait_s": 10.0,
    }
    return AgentKVConfig.model_validate({"engine": engine, **extra})


def stored(coordinator: CoordinatorClient, sequence: list[int], salt: str, chunk: int) -> Callable[[], bool]:
    return lambda: coordinator.lookup(sequence, salt).held_chunks("l2") >= len(sequence) // chunk


@pytest.mark.engine
def test_the_turn_end_pins_what_the_turn_committed(engine_stack: EngineStack) -> None:
    from agentkv import TurnEnded
    from agentkv.engines import EngineBackend

    stack = engine_stack
    direct = CoordinatorClient(stack.coordinator_url, stack.model_path, timeout=30)
    backend = EngineBackend.from_config(engine_config(stack, stack.coordinator_url))
    session = backend.session(f"turn-end-{time.time_ns()}")
    session.extend([{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}])
    session.generate(8)
    pinned_during_the_turn = direct.pins(session.cache_salt)
    # What the turn committed (the user's message, the answer) is pinned now, before park,
    # not when the next turn's first call goes out.
    session.apply(TurnEnded())
    committed = session.store.committed_length() // stack.chunk_size
    assert committed > pinned_during_the_turn
    assert direct.pins(session.cache_salt) == committed
    backend.close(session.session_id)
    assert direct.pins(session.cache_salt) == 0


@pytest.mark.engine
def test_a_coordinator_stalled_mid_turn_leaves_no_pin_and_no_key_after_close(
    engine_stack: EngineStack, proxy: StallingProxy
) -> None:
    from agentkv import ToolCallCompleted
    from agentkv.engines import EngineBackend

    stack = engine_stack
    direct = CoordinatorClient(stack.coordinator_url, stack.model_path, timeout=30)
    # The call's scaffolding is evicted at once (released spans otherwise wait for budget pressure).
    evict_calls = {"tool_call_completed": {"result": "commit", "call": "evict"}}
    backend = EngineBackend.from_config(engine_config(stack, proxy.url, rules=evict_calls))
    session = backend.session(f"stall-{time.time_ns()}")
    salt, store = session.cache_salt, session.store
    history: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": USER},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "name": "timetable", "args": {}}]},
        {"role": "tool", "content": TOOL_RESULT * 2, "tool_call_id": "c1"},
    ]
    session.extend(history)
    history.append({"role": "assistant", "content": session.generate(8)})
    session.apply(ToolCallCompleted("c1"))  # the result is committed, the call's scaffolding evicted
    history.append({"role": "user", "content": " And the way back on Sunday morning, with a bicycle?" * 2})
    session.extend(history)

    # The coordinator stalls while the next call syncs: the stale tail's delete and the moved
    # commit pin both time out; the agent's call still goes out and is answered.
    proxy.stall()
    history.append({"role": "assistant", "content": session.generate(8)})
    assert store.stats.hint_failures >= 2 and "no answer within 1 s" in store.stats.last_failure
    assert session.stats().faults == store.stats.hint_failures  # the session sees its faults
    proxy.resume()
    # The late pin lands: its first chunks now carry one reference more than agentkv's books.
    assert wait_for(lambda: max(direct.pin_counts(salt).values(), default=0) == 2)

    # The next call, coordinator back: the skipped delete is sent again, the surplus given back.
    history.append({"role": "user", "content": " Thanks. Which platform?"})
    session.extend(history)
    session.generate(8)
    assert store.stats.retried_deletes >= 1
    assert store.stats.reconciled_unpins >= 1
    assert set(direct.pin_counts(salt).values()) == {1}
    wait_for(stored(direct, store.sent, salt, stack.chunk_size), 10)  # let the last stores land first

    backend.close(session.session_id)
    assert direct.pins(salt) == 0
    assert wait_for(lambda: salt_keys(stack.coordinator_url, salt) == 0, 30), salt_keys(
        stack.coordinator_url, salt
    )


@pytest.mark.engine
def test_release_and_archive_in_one_step_keep_the_archive_on_l2_for_a_recall(
    engine_stack: EngineStack,
) -> None:
    stack = engine_stack
    coordinator = CoordinatorClient(stack.coordinator_url, stack.model_path, timeout=30)
    vllm = VLLMClient(stack.vllm_url, stack.served_name, timeout=600)
    instance_id, instance_url = next(iter(coordinator.instances().items()))
    spans = spans_of(
        stack.tokenizer,
        [
            (SpanKind.SYSTEM, SYSTEM),
            (SpanKind.USER, USER),
            (SpanKind.TOOL_RESULT, TOOL_RESULT * 3),  # an older tool result: archived
            (SpanKind.TOOL_CALL, TOOL_CALL),  # later scaffolding: released in the same step
            (SpanKind.USER, USER),
        ],
    )
    salt = f"e2e-mixed-{time.time_ns()}"
    target = EngineTarget(
        coordinator, instance_id, instance_url, chunk_size=stack.chunk_size, prefetch_wait=20
    )
    store = EngineStore(target, salt, lambda: spans, bytes_per_token=stack.bytes_per_token)

    def call() -> tuple[list[int], Any]:
        prompt = store.prompt()
        store.sync(prompt)
        before = vllm.metrics()
        done = vllm.complete(prompt, max_tokens=4, cache_salt=salt)
        store.completed(prompt + list(done.token_ids))
        return prompt, vllm.metrics().minus(before)

    full, _ = call()
    assert wait_for(stored(coordinator, full, salt, stack.chunk_size))
    spans[2].state = SpanState.ARCHIVED
    spans[2].tier = store.archive(spans[2], "host")
    spans[3].tier = store.drop(spans[3])
    call()
    size = stack.chunk_size
    kept = spans[3].start // size  # whole chunks before the one holding the first released token
    archived_from = spans[2].start // size
    assert kept > archived_from + 1

    def tiers() -> list[tuple[str, ...]]:
        return [p.tiers for p in coordinator.lookup(full, salt).placements]

    # The archived span's chunks: L2 only (L1 copy given up), under a pin; the released tail: gone.
    assert wait_for(lambda: all(t == ("l2",) for t in tiers()[archived_from + 1 : kept])), tiers()
    assert wait_for(lambda: all(not t for t in tiers()[kept:])), tiers()
    held = kept * size - spans[2].start
    assert store.host_bytes() == held * stack.bytes_per_token
    assert coordinator.pins(salt) >= kept

    # The recall loads the archived span from LMCache (vLLM's own cache emptied first).
    spans[2].state = SpanState.COMMITTED
    restore(store, [spans[2]])
    stack.reset_prefix_cache()
    prompt, delta = call()
    assert prompt[: kept * size] == full[: kept * size]
    assert delta.external_hits >= kept * size - size, delta
    assert spans[2].tier is Tier.DEVICE
    store.close()
    assert coordinator.pins(salt) == 0
    assert store.stats.hint_failures == 0, store.stats.last_failure


@pytest.mark.engine
def test_usage_metadata_is_vllms_usage_for_the_call(engine_stack: EngineStack) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

    from agentkv import ToolCallCompleted
    from agentkv.engines import EngineBackend
    from agentkv_langchain import ChatAgentKV

    stack = engine_stack
    vllm = VLLMClient(stack.vllm_url, stack.served_name, timeout=600)
    backend = EngineBackend.from_config(engine_config(stack, stack.coordinator_url))
    thread = f"usage-{time.time_ns()}"
    llm = ChatAgentKV(backend=backend, session_id=thread, max_tokens=8)
    call = AIMessage("", tool_calls=[{"id": "c1", "name": "timetable", "args": {"to": "Vienna"}}], id="a1")
    history = [
        SystemMessage(SYSTEM, id="s"),
        HumanMessage(USER, id="h1"),
        call,
        ToolMessage(TOOL_RESULT, tool_call_id="c1", id="t1"),
    ]
    first = llm.invoke(history)
    backend.apply(thread, ToolCallCompleted("c1"))  # the call's scaffolding leaves the prompt
    before = vllm.metrics()
    answer = llm.invoke([*history, AIMessage(first.content, id="a2"), HumanMessage("Price?", id="h2")])
    delta = vllm.metrics().minus(before)
    usage = answer.usage_metadata
    assert usage is not None
    assert usage["input_tokens"] == delta.prompt_tokens  # what vLLM was sent ...
    assert usage["input_tokens"] < backend.get(thread).table.logical_length  # ... not the logical history
    assert usage["input_tokens"] - usage["input_token_details"]["cache_read"] == delta.computed_tokens
    backend.close(thread)
