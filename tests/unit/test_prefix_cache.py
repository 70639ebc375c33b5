"""The cross-session prefix cache: threads that start alike encode their system prompt once.

Mechanics of the cache without a model (hash chain, references read from holders,
eviction order, encode-once claims), then on the tiny random Llama: a session that
starts from a shared prefix answers exactly as one that encoded it; one session's
demotions, quantization, evictions and recalls never change what another attends;
a shared entry is freed once its last reference goes; the global budget counts it
once; 8 sessions on 4 threads equal their solo runs and encode the prefix once.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from agentkv import AgentKVConfig, ToolCallCompleted, TransformersBackend, TurnEnded
from agentkv.backend.session import Session
from agentkv.store.prefix_cache import LFUStrategy, PrefixCache
from tests.unit.store_moves import archive, drop, quantize, restore

TOL = 1e-4
PROBE = [5, 6, 7]
SYSTEM = (
    "You are a careful travel assistant. Tools: weather(city) returns the forecast; "
    "flights(origin, destination, date) lists flights; hotels(city, nights) lists rooms. "
    "Always answer briefly and cite the tool you used."
)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- the cache alone ------------------------------------------------------------------------


class Holder:
    """Attends a tensor's storage until told otherwise (a physical cache's `attends`)."""

    def __init__(self, tensor: torch.Tensor | None) -> None:
        self.tensor = tensor

    def attends(self, tensor: torch.Tensor) -> bool:
        held = self.tensor
        return held is not None and held.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()


def kv(n: int, layers: int = 2) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [torch.randn(1, 2, n, 4) for _ in range(layers)], [torch.randn(1, 2, n, 4) for _ in range(layers)]


def test_lookup_finds_the_longest_cached_prefix_past_the_last_block():
    cache = PrefixCache(block_tokens=4)
    ids = list(range(100, 110))  # 10 tokens: two full blocks and 2 more
    keys, values = kv(10)
    entry = cache.insert(ids, keys, values)
    assert entry is not None
    match = cache.lookup([*ids, 1, 2])
    assert match is not None and match.entry is entry and match.length == 10
    partial = cache.lookup([*ids[:6], 0, 0, 0])
    assert partial is not None and partial.length == 6
    assert cache.lookup(ids, limit=9) is not None and cache.lookup(ids, limit=9).length == 9  # type: ignore[union-attr]
    assert cache.lookup([*ids[:3], 0, 0, 0, 0]) is None  # under one block: a miss
    views = match.layer_views()
    assert views[0][0].untyped_storage().data_ptr() == keys[0].untyped_storage().data_ptr()  # no copy


def test_references_are_read_from_holders_and_only_unreferenced_entries_go_lru_first():
    cache = PrefixCache(block_tokens=2)
    first = cache.insert([1, 2, 3, 4], *kv(4))
    second = cache.insert([5, 6, 7, 8], *kv(4))
    assert first is not None and second is not None
    holder = Holder(first.keys[0][..., :2, :])  # a view counts: it keeps the storage
    match = cache.lookup([1, 2, 3, 4, 9])
    assert match is not None
    cache.adopt(match, holder)
    assert first.references() == 1 and second.references() == 0
    assert cache.evict(1) == second.nbytes  # only the unreferenced one may go
    assert [e.entry_id for e in cache.entries()] == [first.entry_id]
    holder.tensor = None  # the holder materialised its own copy, or closed
    assert first.references() == 0
    assert cache.evict(10**9) == first.nbytes and not cache.entries()


def test_eviction_strategy_is_pluggable():
    cache = PrefixCache(block_tokens=2, strategy=LFUStrategy())
    often = cache.insert([1, 2], *kv(2))
    recent = cache.insert([3, 4], *kv(2))
    assert often is not None and recent is not None
    idle = Holder(None)
    for _ in range(3):
        cache.adopt(cache.lookup([1, 2, 0]), idle)  # type: ignore[arg-type]
    cache.adopt(cache.lookup([3, 4, 0]), idle)  # type: ignore[arg-type]  # the most recent use, but the fewest
    cache.evict(1)
    assert [e.entry_id for e in cache.entries()] == [often.entry_id]


def test_max_bytes_evicts_unreferenced_entries_and_refuses_what_cannot_fit():
    keys, values = kv(4)
    one = sum(t.numel() * t.element_size() for t in [*keys, *values])
    cache = PrefixCache(block_tokens=2, max_bytes=one)
    holder = Holder(keys[0])  # holders are weakly held: a session keeps its cache alive
    first = cache.insert([1, 2, 3, 4], keys, values, holder=holder)
    assert first is not None
    assert cache.insert([5, 6, 7, 8], *kv(4)) is None  # the first is attended: no room
    holder.tensor = None
    second = cache.insert([5, 6, 7, 8], *kv(4))
    assert second is not None and [e.entry_id for e in cache.entries()] == [second.entry_id]
    assert cache.stats().bytes == one


def test_a_prefix_is_claimed_by_one_thread_the_others_wait():
    cache = PrefixCache(block_tokens=2)
    encoders: list[int] = []
    started = threading.Barrier(4)

    def first_call(i: int) -> int:
        started.wait()
        with cache.claim([1, 2, 3, 4]) as mine:
            if mine:
                encoders.append(i)
                cache.insert([1, 2, 3, 4], *kv(4))
                return 0
        match = cache.lookup([1, 2, 3, 4, 5])
        return 0 if match is None else match.length

    with ThreadPoolExecutor(4) as pool:
        shared = list(pool.map(first_call, range(4)))
    # Whoever came after the claim was released took the prefix from the cache.
    assert len(encoders) + sum(1 for n in shared if n == 4) == 4
    assert len(cache.entries()) == 1


# -- sessions on the tiny model ---------------------------------------------------------------


def make_backend(tiny_model, tiny_tokenizer, config: dict[str, Any] | None = None, *, share: bool = True):
    settings = {**(config or {}), "prefix_cache": {"enabled": share}}
    return TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig.from_dict(settings))


def history(i: int) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"thread {i}: the booking code is {4100 + i}; weather in city {i}?"},
    ]


def demoted_tokens(session: Session) -> int:
    """Tokens the lifecycle took out of full-precision attention (archived, evicted, held at int4)."""
    stats = session.stats()
    by_state = stats.tokens_by_state
    return (
        by_state["archived"] + by_state["evictable"] + by_state["evicted"] + stats.attended_quantized_tokens
    )


def shared_tokens(session: Session) -> int:
    return session.stats().shared_prefix_tokens


def test_a_session_from_a_shared_prefix_answers_exactly_as_one_that_encoded_it(tiny_model, tiny_tokenizer):
    backend = make_backend(tiny_model, tiny_tokenizer)
    first = backend.session("a")
    first.extend(history(0))
    assert shared_tokens(first) == 0
    second = backend.session("b")
    result = second.extend(history(1))
    shared = shared_tokens(second)
    assert shared >= 64 and result.prefilled_tokens == len(second.token_ids()) - shared
    assert second.stats().shared_device_bytes == shared * backend.runner.bytes_per_token
    alone = make_backend(tiny_model, tiny_tokenizer, share=False).session("b")
    alone.extend(history(1))
    assert alone.token_ids() == second.token_ids()
    assert (second.last_logits - alone.last_logits).abs().max().item() <= TOL
    delta = (second.continuation_logits(PROBE) - alone.continuation_logits(PROBE)).abs().max().item()
    assert delta <= TOL
    assert second.generate(max_new_tokens=6) == alone.generate(max_new_tokens=6)
    # A thread whose history was closed and comes back re-encodes only what follows the prefix.
    backend.close("a")
    again = backend.session("a")
    again.extend(history(0))
    assert shared_tokens(again) == shared
    second.check()
    again.check()


def turn(session: Session, messages: list[dict[str, Any]], i: int, k: int) -> list[str]:
    """One agent turn: a tool call and its result, an answer; returns what was said."""
    call = f"c{i}-{k}"
    messages.extend(
        [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": call, "name": "weather", "args": {"k": k}}],
            },
            {"role": "tool", "content": f"thread {i} result {k}: sunny " * (3 + k), "tool_call_id": call},
        ]
    )
    session.extend(messages)
    session.apply(ToolCallCompleted(call))
    text = session.generate(max_new_tokens=4, message_id=f"m{i}-{k}")
    messages.append({"role": "assistant", "content": text, "id": f"m{i}-{k}"})
    session.apply(TurnEnded())
    messages.append({"role": "user", "content": f"and tomorrow, thread {i} step {k}?"})
    session.extend(messages)
    return [text]


LIFECYCLES = {
    "archive-host": {
        "budget": {"device_tokens": 230},
        "archive_tier": "host",
        "quantization": {"attended_bits": None},
    },
    "attended-int4": {"budget": {"device_tokens": 230}, "quantization": {"attended_bits": 4}},
    "evict-window": {"budget": {"device_tokens": 230}, "policy": "window"},
}


@pytest.mark.parametrize("name", sorted(LIFECYCLES))
def test_sessions_over_one_prefix_never_change_each_others_logits(tiny_model, tiny_tokenizer, name):
    config = {**LIFECYCLES[name], "recall": {"enabled": True}}
    solo: list[tuple[list[str], torch.Tensor]] = []
    for i in range(2):  # each script alone, on a backend that shares nothing
        session = make_backend(tiny_model, tiny_tokenizer, config, share=False).session(f"s{i}")
        messages = history(i)
        session.extend(messages)
        said = [t for k in range(3) for t in turn(session, messages, i, k)]
        solo.append((said, session.continuation_logits(PROBE)))
    backend = make_backend(tiny_model, tiny_tokenizer, config)
    sessions = [backend.session(f"s{i}") for i in range(2)]
    scripts = [history(i) for i in range(2)]
    said: list[list[str]] = [[], []]
    for i, session in enumerate(sessions):
        session.extend(scripts[i])
    assert shared_tokens(sessions[1]) > 0
    entry = backend.prefix_cache.entries()[0]  # type: ignore[union-attr]
    pristine = [k.clone() for k in entry.keys]
    for k in range(3):  # interleaved: each turn demotes, quantizes or evicts under the budget
        for i, session in enumerate(sessions):
            said[i] += turn(session, scripts[i], i, k)
    for i, session in enumerate(sessions):
        session.check()
        assert said[i] == solo[i][0], f"session {i} answered differently ({name})"
        delta = (session.continuation_logits(PROBE) - solo[i][1]).abs().max().item()
        assert delta <= TOL, (name, i, delta)
    assert all(torch.equal(k, p) for k, p in zip(entry.keys, pristine, strict=True))
    assert all(demoted_tokens(s) for s in sessions), f"the budget moved nothing ({name})"
    shared_now = [s.stats().shared_device_bytes for s in sessions]
    if name == "archive-host":  # the pinned prefix stays shared while the tails are archived
        assert all(shared_now)
    else:  # int4 in attention, or tokens evicted from the prefix: the session took its own copy
        assert not all(shared_now)


def test_demoting_a_shared_span_copies_it_first(tiny_model, tiny_tokenizer):
    backend = make_backend(tiny_model, tiny_tokenizer, {"quantization": {"attended_bits": 4}})
    a, b = backend.session("a"), backend.session("b")
    a.extend(history(0))
    b.extend(history(1))
    system = b.spans[0]
    before = a.continuation_logits(PROBE)
    entry = backend.prefix_cache.entries()[0]  # type: ignore[union-attr]
    assert entry.references() == 2
    archive(b.store, system, "host")  # b moves the shared span out of attention
    assert (a.continuation_logits(PROBE) - before).abs().max().item() == 0.0
    restore(b.store, [system])
    assert quantize(b.store, [system]) > 0  # b holds it at int4: its own copy
    assert (a.continuation_logits(PROBE) - before).abs().max().item() == 0.0
    assert entry.references() == 1 and b.stats().shared_device_bytes == 0
    drop(b.store, system)
    assert (a.continuation_logits(PROBE) - before).abs().max().item() == 0.0


def test_a_shared_entry_is_freed_when_its_last_reference_goes(tiny_model, tiny_tokenizer):
    backend = make_backend(tiny_model, tiny_tokenizer)
    cache = backend.prefix_cache
    assert cache is not None
    a, b = backend.session("a"), backend.session("b")
    a.extend(history(0))
    b.extend(history(1))
    (entry,) = cache.entries()
    assert entry.references() == 2
    assert backend.relieve_device(10**12) == 0  # attended: nothing may go
    backend.close("a")
    assert entry.references() == 1 and backend.relieve_device(10**12) == 0
    backend.close("b")
    assert entry.references() == 0
    assert backend.device_bytes() == entry.nbytes  # kept while there is room
    assert backend.relieve_device(1) == entry.nbytes
    assert not cache.entries() and backend.device_bytes() == 0


def test_the_global_budget_counts_shared_bytes_once(tiny_model, tiny_tokenizer):
    bpt = make_backend(tiny_model, tiny_tokenizer).runner.bytes_per_token
    limit = 360 * bpt  # the prefix (152 tokens) and four tails fit; the prefix and `other` do not
    backend = make_backend(tiny_model, tiny_tokenizer, {"budget": {"global_device_bytes": limit}})
    sessions = [backend.session(f"s{i}") for i in range(4)]
    for i, session in enumerate(sessions):
        session.extend(history(i))
    (entry,) = backend.prefix_cache.entries()  # type: ignore[union-attr]
    stats = [s.stats() for s in sessions]
    own = sum(st.device_bytes - st.shared_device_bytes for st in stats)
    assert backend.device_bytes() == entry.nbytes + own < sum(st.device_bytes for st in stats)
    assert backend.device_bytes() <= limit and all(st.budget_satisfied for st in stats)
    assert all(st.shared_device_bytes == entry.nbytes for st in stats)
    # Unreferenced prefixes go first under pressure: a thread with another system prompt
    # takes their room before any session demotes a span.
    for session in sessions:
        backend.close(session.session_id)
    other = backend.session("other")
    other.extend([{"role": "system", "content": SYSTEM.upper()}, {"role": "user", "content": "hi"}])
    assert other.logical_length + entry.length > 360 and other.logical_length <= 0.8 * 360
    assert entry not in backend.prefix_cache.entries()  # type: ignore[union-attr]
    assert demoted_tokens(other) == 0 and backend.device_bytes() <= limit


def test_eight_sessions_on_four_threads_equal_solo_runs_and_encode_the_prefix_once(
    tiny_model, tiny_tokenizer
):
    config = {
        "budget": {"device_tokens": 150},
        "archive_tier": "host",
        "quantization": {"attended_bits": None},
    }

    def run(session: Session, i: int) -> tuple[list[str], torch.Tensor]:
        messages = history(i)
        session.extend(messages)
        said = [t for k in range(2) for t in turn(session, messages, i, k)]
        return said, session.continuation_logits(PROBE)

    solo = [
        run(make_backend(tiny_model, tiny_tokenizer, config, share=False).session("s"), i) for i in range(8)
    ]
    backend = make_backend(tiny_model, tiny_tokenizer, config)
    sessions = [backend.session(f"s{i}") for i in range(8)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, sessions, range(8)))
    for i, ((said, logits), (want_said, want_logits)) in enumerate(zip(results, solo, strict=True)):
        assert said == want_said, f"session {i}"
        assert (logits - want_logits).abs().max().item() <= TOL
        sessions[i].check()
    shared = [shared_tokens(s) for s in sessions]
    assert shared.count(0) == 1 and len({n for n in shared if n}) == 1, shared  # encoded once
    assert len(backend.prefix_cache.entries()) == 1  # type: ignore[union-attr]
