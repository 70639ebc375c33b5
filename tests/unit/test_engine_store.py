"""The lifecycle → engine mapping, against a simulated LMCache coordinator (no server).

`SimLMCache` answers the coordinator's and the LMCache server's routes the way
LMCache 0.5.6 does (prefix-chained chunk keys, reference-counted L2 pins, key
placements per tier, key-addressed deletes, L2 → L1 prefetch), so these tests check
what the store *asks for* and what the cache then *holds*.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from agentkv.engines.http import EngineRequestError, EngineUnavailableError, FakeTransport, Response
from agentkv.engines.lmcache import GIB, CoordinatorClient
from agentkv.engines.store import EngineStore, EngineTarget
from agentkv.engines.vllm import VLLMClient, parse_metrics
from agentkv.spans import Span, SpanKind, SpanState, Tier

CHUNK = 4
COORD = "http://coord:9300"
NODE = "http://node:8301"


class SimLMCache:
    """Chunk keys, placements and pins as the coordinator and one LMCache server keep them."""

    def __init__(self) -> None:
        self.tiers: dict[str, set[str]] = {}  # key -> {"l1", "l2"}
        self.pins: dict[str, int] = {}
        self.salt_of: dict[str, str] = {}
        self.prefetched: list[list[int]] = []
        self.unreported_l1: set[str] = set()
        """Keys whose L1 copy the server holds but has not reported to the coordinator yet
        (placements reach the directory through event reports flushed about once a second)."""
        self.quota_gb: dict[str, float] = {}  # per-salt L2 quotas (GiB)
        self.default_quota_gb: float | None = None
        self.transport = FakeTransport(
            routes={
                "POST /cache/pins": self._pin,
                "DELETE /cache/pins": self._unpin,
                "POST /directory/lookup": self._lookup,
                "DELETE /cache/objects": self._delete,
                "POST /cache/prefetches": self._prefetch,
                "GET /cache/prefetches/*": {"status": "completed"},
                "GET /instances": {"instances": [{"instance_id": "i0", "ip": "node", "http_port": 8301}]},
                "GET /cache/pins*": self._pin_table,
                "GET /quota/config": lambda *_: {"default_limit_gb": self.default_quota_gb},
                "GET /quota/*": self._quota,
            }
        )

    @staticmethod
    def keys(token_ids: list[int], salt: str = "") -> list[str]:
        """Prefix-chained chunk hashes of the complete chunks."""
        out, prev = [], salt
        for i in range(len(token_ids) // CHUNK):
            prev = hashlib.sha1(f"{prev}|{token_ids[i * CHUNK : (i + 1) * CHUNK]}".encode()).hexdigest()[:12]
            out.append(prev)
        return out

    def store(self, token_ids: list[int], salt: str = "") -> None:
        """What the engine does after a request: every complete chunk lands in L1 and L2."""
        for key in self.keys(token_ids, salt):
            self.tiers.setdefault(key, set()).update({"l1", "l2"})

    def held(self, token_ids: list[int], salt: str = "") -> list[set[str]]:
        return [set(self.tiers.get(k, set())) for k in self.keys(token_ids, salt)]

    def _pin(self, _m: str, _p: str, body: Any) -> Any:
        keys = self.keys(body["token_ids"], body["cache_salt"])
        for key in keys:
            self.pins[key] = self.pins.get(key, 0) + 1
            self.salt_of[key] = body["cache_salt"]
        return {"requested": len(keys), "affected": len(keys), "status": "pinned"}

    def _unpin(self, _m: str, _p: str, body: Any) -> Any:
        keys = self.keys(body["token_ids"], body["cache_salt"])
        for key in keys:  # floored at 0, as LMCache's pin table
            if self.pins.get(key, 0) <= 1:
                self.pins.pop(key, None)
            else:
                self.pins[key] -= 1
        return {"requested": len(keys), "affected": len(keys), "status": "unpinned"}

    def _pin_table(self, _m: str, path: str, _b: Any) -> Any:
        query = dict(part.split("=", 1) for part in path.partition("?")[2].split("&") if "=" in part)
        listed = [
            {"key": {"chunk_hash_hex": k, "kv_rank": 0, "cache_salt": self.salt_of[k]}, "pin_count": c}
            for k, c in self.pins.items()
            if not query.get("cache_salt") or self.salt_of.get(k) == query["cache_salt"]
        ]
        offset, limit = int(query.get("offset", 0)), int(query.get("limit", 1000))
        return {"total": len(listed), "pins": listed[offset : offset + limit]}

    def _lookup(self, _m: str, _p: str, body: Any) -> Any:
        keys = self.keys(body["token_ids"], body["cache_salt"])
        results = [
            {
                "key": {"chunk_hash_hex": k, "model_name": body["model_name"], "kv_rank": 0},
                "placements": [
                    {"tier": t, "size_bytes": 100}
                    for t in sorted(self.tiers.get(k, ()))
                    if not (t == "l1" and k in self.unreported_l1)
                ],
            }
            for k in keys
        ]
        return {"chunks": len(keys), "results": results}

    def _delete(self, _m: str, _p: str, body: Any) -> Any:
        tiers = {"l1", "l2"} if body["tier"] == "all" else {body["tier"]}
        deleted = 0
        for key in (k["chunk_hash_hex"] for k in body["keys"]):
            held = self.tiers.get(key, set())
            if held & tiers:
                deleted += 1
            held -= tiers
        return {"deleted": deleted, "skipped": 0, "ok": True}

    def _quota(self, _m: str, path: str, _b: Any) -> Any:
        salt = path.rsplit("/", 1)[-1]
        exists = salt in self.quota_gb
        return {"cache_salt": salt, "quota_exists": exists, "quota_limit_gb": self.quota_gb.get(salt, 0.0)}

    def _prefetch(self, _m: str, _p: str, body: Any) -> Any:
        self.prefetched.append(list(body["token_ids"]))
        for key in self.keys(body["token_ids"], body["cache_salt"]):
            if "l2" in self.tiers.get(key, set()):
                self.tiers[key].add("l1")
        return {"request_id": "r1", "chunks": len(body["token_ids"]) // CHUNK, "status": "submitted"}


def make_spans(*lengths: int) -> list[Span]:
    spans, start = [], 0
    for i, n in enumerate(lengths):
        ids = list(range(100 * (i + 1), 100 * (i + 1) + n))
        spans.append(Span(span_id=i, kind=SpanKind.USER, token_ids=ids, start=start, n_computed=n))
        start += n
    return spans


@pytest.fixture
def sim() -> SimLMCache:
    return SimLMCache()


def restore(store: EngineStore, spans: list[Span]) -> None:
    """Restore archived spans and write the tiers the store returns, as the lifecycle's mover does."""
    result = store.restore_many(spans)
    for span in spans:
        span.tier = result.tiers[span.span_id]


def make_store(sim: SimLMCache, spans: list[Span], **kw: Any) -> EngineStore:
    coordinator = CoordinatorClient(COORD, "m", transport=sim.transport)
    target = EngineTarget(
        coordinator, instance_id="i0", instance_url=NODE, chunk_size=CHUNK, prefetch_wait=0.5
    )
    return EngineStore(target, "salt", lambda: spans, bytes_per_token=10, **kw)


def turn(store: EngineStore, sim: SimLMCache, generated: list[int] | None = None) -> list[int]:
    """One engine call: sync, then the engine stores the prompt + generated ids."""
    prompt = store.prompt()
    store.sync(prompt)
    sequence = prompt + (generated or [])
    sim.store(sequence, "salt")
    store.completed(sequence)
    return prompt


def test_commit_pins_the_prompt_prefix_through_the_span_in_whole_chunks(sim: SimLMCache) -> None:
    spans = make_spans(6, 5, 7)  # 18 tokens
    store = make_store(sim, spans)
    turn(store, sim)
    spans[1].state = SpanState.COMMITTED  # prefix through span 1 = 11 tokens -> 2 whole chunks
    turn(store, sim)
    pinned = sim.transport.sent("POST", "/cache/pins")
    assert [len(b["token_ids"]) for b in pinned] == [8]
    assert set(sim.pins) == set(sim.keys(store.prompt()[:8], "salt"))
    # A longer commit moves the pin: the new prefix is pinned before the old one is given back.
    spans[2].state = SpanState.COMMITTED
    turn(store, sim)
    assert [len(b["token_ids"]) for b in sim.transport.sent("POST", "/cache/pins")] == [8, 16]
    assert [len(b["token_ids"]) for b in sim.transport.sent("DELETE", "/cache/pins")] == [8]
    assert set(sim.pins) == set(sim.keys(store.prompt()[:16], "salt"))
    assert all(count == 1 for count in sim.pins.values())


def test_release_leaves_the_span_out_and_deletes_only_the_stale_tail(sim: SimLMCache) -> None:
    spans = make_spans(8, 8, 8)
    store = make_store(sim, spans)
    first = turn(store, sim, generated=[7, 7, 7, 7])
    spans[1].tier = store.drop(spans[1])  # release/evict the middle span
    prompt = store.prompt()
    assert prompt == spans[0].token_ids + spans[2].token_ids
    turn(store, sim)
    old = first + [7, 7, 7, 7]
    held = sim.held(old, "salt")
    assert held[:2] == [{"l1", "l2"}] * 2  # the kept prefix (span 0) is untouched
    assert held[2:] == [set()] * 5  # everything after the change is gone from every tier
    assert sim.held(prompt, "salt") == [{"l1", "l2"}] * 4  # the new sequence is stored


def test_archive_deletes_l1_keeps_l2_pinned_and_recall_prefetches_it_back(sim: SimLMCache) -> None:
    spans = make_spans(8, 8, 8)
    store = make_store(sim, spans)
    full = turn(store, sim)
    spans[1].tier = store.archive(spans[1], "host")
    assert spans[1].tier is Tier.HOST
    turn(store, sim)
    assert sim.held(full, "salt")[2:] == [{"l2"}] * 4  # L1 copy gone, L2 kept
    assert set(sim.keys(full, "salt")) <= set(sim.pins)  # and protected from L2 eviction
    restore(store, [spans[1]])
    turn(store, sim)
    assert sim.prefetched == [full]  # prefetched before the call that needs it
    assert sim.held(full, "salt") == [{"l1", "l2"}] * 6
    assert not set(sim.keys(full, "salt")[2:]) & set(sim.pins)  # the archive pin is given back


def test_pins_stay_within_the_salts_l2_quota_across_commit_and_archive_pins(sim: SimLMCache) -> None:
    spans = make_spans(8, 8, 8)
    sim.quota_gb["salt"] = 100 / GIB  # 100 bytes = 10 tokens at 10 bytes per token: 2 whole chunks
    store = make_store(sim, spans)
    turn(store, sim)
    for span in spans:
        span.state = SpanState.COMMITTED
    turn(store, sim)
    assert store.pin_budget() == 10
    assert [len(b["token_ids"]) for b in sim.transport.sent("POST", "/cache/pins")] == [8]
    # An archive pin shares the budget: its first chunks are the commit pin's, nothing beyond fits.
    spans[2].tier = store.archive(spans[2], "host")
    turn(store, sim)
    assert set(sim.pins) == set(sim.keys(spans[0].token_ids, "salt"))
    assert store.stats.hint_failures == 0


def test_configured_pin_budget_caps_pins_without_a_quota(sim: SimLMCache) -> None:
    spans = make_spans(8, 8)
    coordinator = CoordinatorClient(COORD, "m", transport=sim.transport)
    target = EngineTarget(coordinator, "i0", NODE, chunk_size=CHUNK, pin_budget_tokens=5)
    store = EngineStore(target, "salt", lambda: spans, bytes_per_token=10)
    spans[0].state = spans[1].state = SpanState.COMMITTED
    turn(store, sim)
    assert [len(b["token_ids"]) for b in sim.transport.sent("POST", "/cache/pins")] == [4]
    sim.default_quota_gb = None
    assert make_store(sim, spans).pin_budget() is None  # no quota, no budget: no cap


def test_turn_end_parks_the_pinned_prefix_on_l2_and_the_next_call_prefetches_it(sim: SimLMCache) -> None:
    spans = make_spans(8, 8, 3)
    store = make_store(sim, spans)
    turn(store, sim)
    spans[0].state = spans[1].state = SpanState.COMMITTED
    prompt = turn(store, sim)  # pins the first 16 tokens
    only_l1 = sim.keys(prompt[:16], "salt")[3]
    sim.tiers[only_l1] = {"l1"}  # not on L2 (yet): it must keep its L1 copy
    store.park()
    assert sim.held(prompt[:16], "salt") == [{"l2"}] * 3 + [{"l1"}]
    assert store.stats.demoted_chunks == 3
    turn(store, sim)
    assert sim.prefetched == [prompt]  # brought back L2 -> L1 before the conversation's next call
    assert sim.held(prompt[:12], "salt") == [{"l1", "l2"}] * 3
    store.park()  # parked twice without a call in between: nothing left to demote
    store.park()
    assert store.stats.hint_failures == 0


def test_park_demotes_l1_copies_the_coordinator_has_not_listed_yet(sim: SimLMCache) -> None:
    # A recall's prefetch (or vLLM's retrieve) puts chunks back in L1 right before the call;
    # the coordinator lists those L1 copies only once the server's next event report lands.
    # Park must not trust that view for L1: the fresh copies would outlive the park.
    spans = make_spans(8, 8, 3)
    store = make_store(sim, spans)
    turn(store, sim)
    spans[0].state = spans[1].state = SpanState.COMMITTED
    prompt = turn(store, sim)
    fresh = sim.keys(prompt[:16], "salt")[2:]
    sim.unreported_l1.update(fresh)
    store.park()
    assert sim.held(prompt[:16], "salt") == [{"l2"}] * 4
    assert store.stats.demoted_chunks == 4


def test_branch_shares_the_salt_and_never_deletes_the_parent_prefix(sim: SimLMCache) -> None:
    parent_spans = make_spans(8, 8)
    parent = make_store(sim, parent_spans)
    shared = turn(parent, sim)
    branch_spans = [*parent_spans, *make_spans(0, 0, 8)[2:]]
    branch_spans[-1].start = 16
    branch = make_store(sim, branch_spans, shared_prefix=shared)
    assert branch.cache_salt == parent.cache_salt
    turn(branch, sim)
    branch.close()  # pruned: its own tail goes, the shared prefix stays
    assert sim.held(shared, "salt") == [{"l1", "l2"}] * 4
    assert sim.held(branch.prompt(), "salt")[4:] == [set()] * 2


def test_close_gives_back_every_pin(sim: SimLMCache) -> None:
    spans = make_spans(8, 8, 8)
    store = make_store(sim, spans)
    turn(store, sim)
    spans[0].state = SpanState.COMMITTED
    spans[2].tier = store.archive(spans[2], "host")
    turn(store, sim)
    store.select()
    assert sim.pins
    store.close()
    assert sim.pins == {}
    assert store.stats.hint_failures == 0


def test_engine_down_makes_hints_logged_noops(sim: SimLMCache, caplog: pytest.LogCaptureFixture) -> None:
    spans = make_spans(8, 8)
    store = make_store(sim, spans)
    turn(store, sim)
    sim.transport.down = True
    spans[0].state = SpanState.COMMITTED
    spans[1].tier = store.drop(spans[1])
    store.sync(store.prompt())  # no exception: hints never break the agent
    assert store.stats.hint_failures >= 1
    assert "connection refused" in store.stats.last_failure
    assert "engine hint" in caplog.text


def test_coordinator_4xx_is_a_clear_error_for_direct_calls_and_a_noop_as_a_hint(sim: SimLMCache) -> None:
    sim.transport.routes["POST /cache/pins"] = Response(400, {"detail": "token cap exceeded"})
    client = CoordinatorClient(COORD, "m", transport=sim.transport)
    with pytest.raises(EngineRequestError, match=r"POST http://coord:9300/cache/pins: HTTP 400: token cap"):
        client.pin([1, 2, 3, 4])
    spans = make_spans(8)
    store = make_store(sim, spans)
    spans[0].state = SpanState.COMMITTED
    store.sync(store.prompt())
    assert store.stats.hint_failures == 1 and "HTTP 400" in store.stats.last_failure


def test_bytes_by_tier_counts_the_prompt_and_what_l2_keeps_of_the_archive(sim: SimLMCache) -> None:
    spans = make_spans(8, 8, 8)
    store = make_store(sim, spans)
    spans[0].tier = store.archive(spans[0], "host")  # never sent: the engine holds nothing of it
    assert store.bytes_by_tier().host == 0
    restore(store, [spans[0]])
    turn(store, sim)
    spans[1].tier = store.archive(spans[1], "host")
    spans[2].tier = store.drop(spans[2])
    tiers = store.bytes_by_tier()
    assert (tiers.device, tiers.host, tiers.quantized) == (80, 80, 0)
    assert store.span_bytes(spans[2]) == 0
    turn(store, sim)  # span 1's chunks end before the dropped span: L2 keeps them
    assert store.bytes_by_tier().host == 80 == store.span_bytes(spans[1])


def test_client_validation_names_expected_and_actual() -> None:
    with pytest.raises(ValueError, match="expected http:// or https://, got 'coord:9300'"):
        CoordinatorClient("coord:9300", "m")
    client = CoordinatorClient(COORD, "m", transport=FakeTransport())
    with pytest.raises(ValueError, match="tier: expected one of l1, l2, all, got 'l3'"):
        client.delete("i0", [1, 2], tier="l3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expected the sequence from position 0"):
        client.pin([])


def test_vllm_client_sends_ids_salt_and_transfer_params_and_reads_usage() -> None:
    answer = {
        "choices": [{"text": " hi", "token_ids": [5, 6], "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 2}},
    }
    transport = FakeTransport(routes={"POST /v1/completions": answer})
    client = VLLMClient("http://v:8000", "m", transport=transport)
    done = client.complete([1, 2, 3], max_tokens=2, cache_salt="s", kv_transfer_params={"x": 1})
    (body,) = transport.sent("POST", "/v1/completions")
    assert (
        body["prompt"] == [1, 2, 3] and body["cache_salt"] == "s" and body["kv_transfer_params"] == {"x": 1}
    )
    assert (done.text, done.token_ids, done.cached_tokens) == (" hi", (5, 6), 2)
    with pytest.raises(EngineUnavailableError, match="connection refused"):
        VLLMClient("http://v:8000", "m", transport=FakeTransport(down=True)).complete([1])
    bad = FakeTransport(routes={"POST /v1/completions": {"oops": 1}})
    with pytest.raises(EngineRequestError, match="unexpected completion body"):
        VLLMClient("http://v:8000", "m", transport=bad).complete([1])


def test_metrics_parse_sums_label_sets_and_reads_computed_tokens() -> None:
    text = "\n".join(
        [
            "# HELP vllm:prompt_tokens_total x",
            'vllm:prompt_tokens_total{engine="0",model_name="m"} 120.0',
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 64.0',
            'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 16.0',
            'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 40.0',
            'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 64.0',
        ]
    )
    metrics = parse_metrics(text)
    assert (metrics.prompt_tokens, metrics.prefix_cache_hits, metrics.external_hits) == (120, 64, 16)
    assert metrics.computed_tokens == 40


def test_engine_yaml_block_is_validated_with_paths(tmp_path: Any) -> None:
    from agentkv import AgentKVConfig

    good = AgentKVConfig.model_validate(
        {"engine": {"vllm_url": "http://127.0.0.1:8000", "coordinator_url": "http://127.0.0.1:9300"}}
    )
    assert good.engine is not None and good.engine.salt == "conversation" and good.engine.chunk_size == 256
    assert AgentKVConfig().engine is None  # no block = the local model
    path = tmp_path / "graph.yaml"
    path.write_text("agentkv:\n  engine:\n    vllm_url: localhost:8000\n    salt: per_user\n    chunk: 3\n")
    with pytest.raises(ValueError) as info:
        AgentKVConfig.from_yaml(path)
    text = str(info.value)
    assert "agentkv.engine.vllm_url: expected an http:// or https:// URL, got 'localhost:8000'" in text
    assert "agentkv.engine.salt: unknown value 'per_user'; allowed: 'conversation' or 'shared'" in text
    assert "agentkv.engine.chunk" in text


# -- EngineBackend + EngineSession: the real lifecycle manager, a simulated engine ---------------


def fake_engine(sim: SimLMCache) -> FakeTransport:
    """One transport for vLLM and the coordinator: completions answer " ok" and store the sequence."""

    def complete(_m: str, _p: str, body: Any) -> Any:
        prompt = list(body["prompt"])
        held = sum(CHUNK for tiers in sim.held(prompt, body.get("cache_salt", "")) if tiers)
        sim.store([*prompt, 9, 9], body.get("cache_salt", ""))
        return {
            "choices": [{"text": " ok", "token_ids": [9, 9], "finish_reason": "length"}],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": 2,
                "prompt_tokens_details": {"cached_tokens": held},
            },
        }

    sim.transport.routes["POST /v1/completions"] = complete
    return sim.transport


def make_backend(sim: SimLMCache, tokenizer: Any, **config: Any) -> Any:
    from agentkv import AgentKVConfig
    from agentkv.engines import EngineBackend

    engine = {"vllm_url": "http://v:8000", "coordinator_url": COORD, "chunk_size": CHUNK}
    settings = AgentKVConfig.model_validate({"engine": engine, **config})
    return EngineBackend(tokenizer, settings, bytes_per_token=10, transport=fake_engine(sim))


def test_engine_session_events_drive_pins_and_stale_tail_deletes(
    sim: SimLMCache, tiny_tokenizer: Any
) -> None:
    from agentkv import ToolCallCompleted, TurnEnded

    backend = make_backend(sim, tiny_tokenizer)
    session = backend.session("t1")
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a rail assistant. " * 4},
        {"role": "user", "content": "Zurich to Vienna tonight?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "name": "timetable", "args": {}}]},
        {"role": "tool", "content": "Nightjet 466 at 21:40, platform 7.", "tool_call_id": "c1"},
    ]
    session.extend(history)
    assert session.generate(4) == " ok"
    call_span = next(s for s in session.spans if s.kind.value == "tool_call")
    result_span = next(s for s in session.spans if s.kind.value == "tool_result")
    session.apply(ToolCallCompleted("c1"))  # default rules: result committed, the call released
    session.apply(TurnEnded())
    session.extend([*history, {"role": "assistant", "content": " ok"}, {"role": "user", "content": "Price?"}])
    session.generate(4)
    assert result_span.state.value == "committed" and call_span.state.value == "evictable"
    # The commit pinned the prompt prefix through the committed spans, in whole chunks.
    pinned = sim.transport.sent("POST", "/cache/pins")[-1]["token_ids"]
    assert len(pinned) % CHUNK == 0 and len(pinned) >= result_span.end // CHUNK * CHUNK - CHUNK
    assert set(sim.keys(pinned, "t1")) == set(sim.pins)
    assert session.store.stats.hint_failures == 0
    stats = session.stats()
    assert stats.reused_tokens > 0 and stats.prefill_tokens > 0  # from the engine's own usage
    backend.close("t1")
    assert sim.pins == {}


def test_engine_session_budget_drops_released_spans_from_the_prompt(
    sim: SimLMCache, tiny_tokenizer: Any
) -> None:
    from agentkv import ToolCallCompleted

    backend = make_backend(sim, tiny_tokenizer, budget={"device_tokens": 64})
    session = backend.session("t2")
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Look it up."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c9", "name": "search", "args": {"q": "x"}}],
        },
        {"role": "tool", "content": "result " * 60, "tool_call_id": "c9"},
    ]
    session.extend(history)
    session.generate(2)
    sent_before = list(session.store.sent)
    session.apply(ToolCallCompleted("c9"))
    session.extend([*history, {"role": "assistant", "content": " ok"}, {"role": "user", "content": "So?"}])
    session.generate(2)
    dropped = [s for s in session.spans if s.tier.value != "device"]
    assert dropped, "the budget demoted spans"
    prompt = session.store.prompt()
    assert len(prompt) == sum(s.length for s in session.spans if s.tier.value == "device")
    assert len(prompt) < sum(s.length for s in session.spans)  # the demoted spans are left out
    assert sim.transport.sent("DELETE", "/cache/objects")  # the stale tail of the old sequence
    assert session.stats().device_bytes == len(prompt) * 10
    assert sent_before  # the engine held the first sequence


def test_engine_down_the_agent_still_gets_a_clear_error_from_vllm_and_no_hint_error(
    sim: SimLMCache, tiny_tokenizer: Any
) -> None:
    backend = make_backend(sim, tiny_tokenizer)
    session = backend.session("t3")
    session.extend([{"role": "user", "content": "hi"}])
    sim.transport.down = True
    with pytest.raises(EngineUnavailableError, match="v:8000/v1/completions"):
        session.generate(2)
    assert [s.generated for s in session.spans] == [False]  # the failed answer left no span behind
    sim.transport.down = False
    assert session.generate(2) == " ok"


def test_bench_events_mode_sends_lrus_prompts_and_only_adds_hints() -> None:
    from agentkv_bench.engine import EngineBenchSettings, _mode_config, run_engine_bench

    settings = EngineBenchSettings("http://v:1", COORD, chunk_size=CHUNK, device_tokens=384)
    lru = _mode_config("lru", settings)
    events = _mode_config("events", settings)
    budgeted = _mode_config("events+budget", settings)
    assert lru.engine is not None and lru.engine.coordinator_url is None
    assert events.engine is not None and events.engine.coordinator_url == COORD
    assert events.policy.name == lru.policy.name == "full"  # no budget: no span leaves the prompt
    assert budgeted.policy.name != "full" and budgeted.budget.device_tokens == 384
    with pytest.raises(
        ValueError, match="mode: expected one of lru, events, events-gated, events\\+budget, got 'lfu'"
    ):
        _mode_config("lfu", settings)
    with pytest.raises(ValueError, match="modes: expected some of"):
        run_engine_bench(settings, modes=("lru", "mru"))
    with pytest.raises(ValueError, match="threads: expected 1..64, got 0"):
        EngineBenchSettings("http://v:1", COORD, threads=0)
    with pytest.raises(ValueError, match="expected one of them, got both"):
        EngineBenchSettings("http://v:1", COORD, l2_quota_gb=1.0, fleet_l2_gb=2.0)


def test_engine_sessions_report_prefixes_the_engine_shared_across_threads(
    sim: SimLMCache, tiny_tokenizer: Any
) -> None:
    from agentkv import AgentKVConfig
    from agentkv.engines import EngineBackend

    engine = {"vllm_url": "http://v:8000", "coordinator_url": COORD, "chunk_size": CHUNK, "salt": "shared"}
    settings = AgentKVConfig.model_validate({"engine": engine})
    backend = EngineBackend(tiny_tokenizer, settings, bytes_per_token=10, transport=fake_engine(sim))
    system = {"role": "system", "content": "You are a rail assistant with timetable tools. " * 6}
    first, second = backend.session("a"), backend.session("b")
    first.extend([system, {"role": "user", "content": "Zurich to Vienna?"}])
    first.generate(4)
    assert first.stats().shared_prefix_tokens == 0  # nothing to share yet
    second.extend([system, {"role": "user", "content": "Bern to Milan?"}])
    second.generate(4)
    shared = second.stats().shared_prefix_tokens
    assert shared >= CHUNK and shared == second.stats().reused_tokens  # the same field as the local backend
    second.extend(
        [
            system,
            {"role": "user", "content": "Bern to Milan?"},
            {"role": "assistant", "content": " ok"},
            {"role": "user", "content": "And back?"},
        ]
    )
    second.generate(4)
    assert second.stats().shared_prefix_tokens == shared  # its own history is not someone else's prefix


def test_an_engine_answer_cut_at_a_stop_string_holds_its_text(sim: SimLMCache, tiny_tokenizer: Any) -> None:
    """vLLM returns the stop string's ids with the cut text: the session keeps the ids that spell the text."""
    said = tiny_tokenizer.encode(" the gate code is 4417 STOP and more", add_special_tokens=False)
    text = tiny_tokenizer.decode(said).split("STOP")[0]

    def complete(_m: str, _p: str, body: Any) -> Any:
        return {
            "choices": [{"text": text, "token_ids": said, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(said)},
        }

    backend = make_backend(sim, tiny_tokenizer)
    sim.transport.routes["POST /v1/completions"] = complete
    session = backend.session("t1")
    session.extend([{"role": "user", "content": "What is the gate code?"}])
    assert session.generate(max_new_tokens=len(said), stop=["STOP"]) == text
    (answer,) = [s for s in session.spans if s.generated]
    assert tiny_tokenizer.decode(answer.token_ids) == answer.text
    assert "STOP" not in tiny_tokenizer.decode(session.engine_sequence)  # what the next prompt extends
