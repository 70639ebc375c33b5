"""Many sessions on one backend at once: no deadlock, no leakage, exact accounting.

8 worker threads drive 32 sessions through the same kind of script an agent
runs (extend, generate, tool events, confirmations) with their operations
interleaved; a monitor thread reads stats and global bytes meanwhile. Each
session's final `continuation_logits` must equal a solo run of the same script
(per-session budgets make a session's behaviour independent of the others), the
byte accounting must be exact, and `backend.device_bytes()` must equal the sum
of the sessions' bytes. The same scripts also run through `asyncio.gather` of
`asyncio.to_thread` calls, and under a *global* budget that makes sessions
account for each other while they run (the case that can deadlock).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from agentkv import AgentKVConfig, ToolCallCompleted, TransformersBackend, TurnEnded, UserConfirmed
from agentkv.backend.session import Session
from tests.unit.store_accounting import assert_tier_bytes

SESSIONS = 32
WORKERS = 8
TIMEOUT_S = 240.0
TOL = 1e-4
PROBE = [5, 6, 7]
CONFIG = {
    "budget": {"device_tokens": 110, "host_tokens": 200},
    "archive_tier": "host",
    "quantization": {"attended_bits": None},  # pressure archives at once: host-tier moves under threads
}
ATTENDED_CONFIG = {**CONFIG, "quantization": {"attended_bits": 4}}
"""The default demotion order: spans held at int4 in attention (per-thread dequantized reads) first."""

Op = Callable[[Session, dict[str, Any]], None]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny-model matrices gain nothing from intra-op threads, and on a busy CI machine two
    spinning OpenMP threads per forward make these many small forwards ~30x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def script(i: int) -> list[Op]:
    """Session i's operations; the text depends on i so leakage between sessions would show."""
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": f"session {i}: the secret code is {4000 + i} lorem ipsum"},
    ]
    call = f"call_{i}"

    def first(s: Session, out: dict[str, Any]) -> None:
        s.extend(history)

    def answer(tokens: int) -> Op:
        def run(s: Session, out: dict[str, Any]) -> None:
            text = s.generate(max_new_tokens=tokens, message_id=f"a{i}-{len(history)}")
            out.setdefault("answers", []).append(text)
            history.append({"role": "assistant", "content": text, "id": f"a{i}-{len(history)}"})

        return run

    def tool_turn(s: Session, out: dict[str, Any]) -> None:
        history.extend(
            [
                {"role": "user", "content": f"what is the weather in city {i}?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"id": call, "name": "weather", "args": {"n": i}}],
                },
                {
                    "role": "tool",
                    "content": f"search results {i}: sunny skies " * (1 + i % 3),
                    "tool_call_id": call,
                },
            ]
        )
        s.extend(history)

    def last(s: Session, out: dict[str, Any]) -> None:
        history.append({"role": "user", "content": f"thanks; remind me of code {4000 + i}?"})
        s.extend(history)

    return [
        first,
        answer(3),
        lambda s, out: out.setdefault("events", []).append(s.apply(TurnEnded()).applied),
        tool_turn,
        lambda s, out: out.setdefault("events", []).append(s.apply(ToolCallCompleted(call)).applied),
        answer(2),
        lambda s, out: out.setdefault("events", []).append(s.apply(UserConfirmed()).applied),
        last,
    ]


def finish(session: Session, out: dict[str, Any]) -> None:
    out["logits"] = session.continuation_logits(PROBE)
    out["tokens"] = session.token_ids()


def solo_runs(model: Any, tokenizer: Any, config: dict[str, Any] = CONFIG) -> list[dict[str, Any]]:
    backend = TransformersBackend(model, tokenizer, AgentKVConfig.from_dict(config))
    results: list[dict[str, Any]] = []
    for i in range(SESSIONS):
        session = backend.session(f"s{i}")
        out: dict[str, Any] = {}
        for op in script(i):
            op(session, out)
        finish(session, out)
        results.append(out)
    return results


@pytest.fixture(scope="module")
def solo(tiny_model, tiny_tokenizer) -> list[dict[str, Any]]:
    return solo_runs(tiny_model, tiny_tokenizer)


def assert_final_state(backend: TransformersBackend, sessions: list[Session]) -> None:
    total_device = 0
    for session in sessions:
        session.check()
        stats = session.stats()
        assert_tier_bytes(session)  # each tier's bytes are the tensors it holds
        total_device += stats.device_bytes + stats.quantized_bytes
    assert backend.device_bytes() == total_device


def assert_same_as_solo(results: list[dict[str, Any]], solo: list[dict[str, Any]]) -> None:
    for i, (got, want) in enumerate(zip(results, solo, strict=True)):
        assert got["answers"] == want["answers"], f"session {i} answered differently"
        assert got["events"] == want["events"]
        assert got["tokens"] == want["tokens"], f"session {i} holds other tokens"
        delta = (got["logits"] - want["logits"]).abs().max().item()
        assert delta <= TOL, f"session {i}: logits differ from its solo run by {delta}"


def run_interleaved(backend: TransformersBackend, *, monitor: bool = True) -> list[dict[str, Any]]:
    """WORKERS threads take turns: each op of a session runs when its previous op is done."""
    sessions = [backend.session(f"s{i}") for i in range(SESSIONS)]
    scripts = [script(i) for i in range(SESSIONS)]
    results: list[dict[str, Any]] = [{} for _ in range(SESSIONS)]
    steps = [0] * SESSIONS
    ready: queue.Queue[int | None] = queue.Queue()
    for i in range(SESSIONS):
        ready.put(i)
    remaining = [SESSIONS]
    lock = threading.Lock()
    errors: list[BaseException] = []
    done = threading.Event()

    def worker() -> None:
        while True:
            i = ready.get()
            if i is None:
                return
            try:
                if steps[i] < len(scripts[i]):
                    scripts[i][steps[i]](sessions[i], results[i])
                    steps[i] += 1
                    ready.put(i)
                    continue
                finish(sessions[i], results[i])
            except BaseException as e:  # noqa: BLE001 - reported by the test thread
                errors.append(e)
            with lock:
                remaining[0] -= 1
                if remaining[0] == 0 or errors:
                    done.set()

    def watch() -> None:
        while not done.is_set():
            backend.device_bytes()
            for session in sessions:
                session.stats()
            time.sleep(0.002)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(WORKERS)]
    if monitor:
        threads.append(threading.Thread(target=watch, daemon=True))
    for thread in threads:
        thread.start()
    finished = done.wait(TIMEOUT_S)
    for _ in range(WORKERS):
        ready.put(None)
    for thread in threads:
        thread.join(timeout=5)
    assert finished, (
        f"deadlock or stall: {remaining[0]} sessions unfinished after {TIMEOUT_S}s, steps {steps}"
    )
    if errors:
        raise errors[0]
    assert sum(steps) == SESSIONS * len(scripts[0])
    return results


def test_threads_drive_sessions_without_leakage(tiny_model, tiny_tokenizer, solo):
    backend = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig.from_dict(CONFIG))
    results = run_interleaved(backend)
    assert_same_as_solo(results, solo)
    sessions = [backend.get(f"s{i}") for i in range(SESSIONS)]
    assert any(s.stats().host_bytes for s in sessions), "the budget should have archived something"
    assert_final_state(backend, sessions)


def test_threads_drive_attended_sessions_without_leakage(tiny_model, tiny_tokenizer):
    """The attended int4 tier under threads: each thread's remembered read is its own layer's."""
    solo = solo_runs(tiny_model, tiny_tokenizer, ATTENDED_CONFIG)
    backend = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig.from_dict(ATTENDED_CONFIG))
    results = run_interleaved(backend)
    assert_same_as_solo(results, solo)
    sessions = [backend.get(f"s{i}") for i in range(SESSIONS)]
    assert any(s.store.attended_quantized_tokens() for s in sessions), "the budget should have quantized"
    assert_final_state(backend, sessions)


def test_asyncio_to_thread_drives_sessions_without_leakage(tiny_model, tiny_tokenizer, solo):
    backend = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig.from_dict(CONFIG))

    async def drive(i: int) -> dict[str, Any]:
        session = await asyncio.to_thread(backend.session, f"s{i}")
        out: dict[str, Any] = {}
        for op in script(i):
            await asyncio.to_thread(op, session, out)
        await asyncio.to_thread(finish, session, out)
        return out

    async def main() -> list[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(WORKERS))
        work = asyncio.gather(*(drive(i) for i in range(SESSIONS)))
        try:
            return list(await asyncio.wait_for(work, TIMEOUT_S))
        except TimeoutError:
            # asyncio.run would wait forever for stuck workers: hand it an idle executor to close.
            loop.set_default_executor(ThreadPoolExecutor(1))
            raise

    results = asyncio.run(main())
    assert_same_as_solo(results, solo)
    assert_final_state(backend, [backend.get(f"s{i}") for i in range(SESSIONS)])


def test_global_budget_under_concurrency_does_not_deadlock(tiny_model, tiny_tokenizer):
    """A global budget makes each session read every other session's bytes while holding its own lock."""
    bpt = 2 * 3 * 2 * 16 * 4  # tiny model: 2 (k, v) x 3 layers x 2 kv heads x 16 head dim x fp32
    config = {**CONFIG, "budget": {"global_device_bytes": 32 * 60 * bpt, "host_tokens": 400}}
    backend = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig.from_dict(config))
    assert backend.runner.bytes_per_token == bpt
    run_interleaved(backend)
    sessions = [backend.get(f"s{i}") for i in range(SESSIONS)]
    assert_final_state(backend, sessions)
    assert sum(s.stats().host_bytes for s in sessions) > 0, "the global budget should have archived something"
    for session in sessions:
        assert all(span.token_ids for span in session.spans)
    assert backend.device_bytes() <= 32 * 60 * bpt or any(not s.stats().budget_satisfied for s in sessions)
