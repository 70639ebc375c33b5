"""Every policy through the same checks on real keys from the tiny model, then each one's own semantics."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import DynamicCache, PreTrainedModel

from agentkv.policies import (
    POLICY_NAMES,
    AttentionProbe,
    H2OPolicy,
    IntentPolicy,
    KeyNormPolicy,
    KindPriorPolicy,
    Policy,
    ProtectRecentPolicy,
    ProtectSinksPolicy,
    SlidingWindowPolicy,
    SnapKVPolicy,
    SpanView,
    StreamingLLMPolicy,
    TOVAPolicy,
    WeightedSumPolicy,
    make_policy,
    policy_params,
    span_relevance,
)
from agentkv.spans import SpanKind

N_TOKENS = 60
QUERY_TOKENS = 8
SPANS: tuple[tuple[SpanKind, int], ...] = (
    (SpanKind.SYSTEM, 6),
    (SpanKind.USER, 8),
    (SpanKind.ASSISTANT, 8),
    (SpanKind.TOOL_CALL, 8),
    (SpanKind.TOOL_RESULT, 12),
    (SpanKind.REASONING, 10),
    (SpanKind.PROMPT, 8),
)
assert sum(n for _, n in SPANS) == N_TOKENS


def _span_layout() -> tuple[torch.Tensor, dict[int, SpanKind]]:
    span_ids = torch.cat([torch.full((n,), i, dtype=torch.long) for i, (_, n) in enumerate(SPANS)])
    return span_ids, {i: kind for i, (kind, _) in enumerate(SPANS)}


@pytest.fixture(scope="module")
def view(tiny_model: PreTrainedModel) -> SpanView:
    """A view over 60 real cached tokens: keys from a DynamicCache, attention from the probe."""
    ids = torch.randint(3, 512, (1, N_TOKENS), generator=torch.Generator().manual_seed(11))
    cache = DynamicCache(config=tiny_model.config)
    with torch.no_grad(), AttentionProbe(tiny_model, QUERY_TOKENS, keep_queries=True) as probe:
        tiny_model(input_ids=ids, cache=cache, use_cache=True)
    keys: tuple[torch.Tensor, ...] = tuple(layer.keys for layer in cache.layers)  # type: ignore[union-attr, misc]
    attention = probe.attention()
    span_ids, kinds = _span_layout()
    return SpanView(
        keys=keys,
        positions=torch.arange(N_TOKENS),
        span_ids=span_ids,
        span_kinds=kinds,
        sequence_length=N_TOKENS,
        attention=attention,
        accumulated_attention=attention,
        query_keys=tuple(k[..., -QUERY_TOKENS:, :] for k in keys),
        query_states=probe.query_states,
    )


MATRIX_NAMES = [name for name in POLICY_NAMES if name != "full"]
COMPOSED: dict[str, Policy] = {
    "weighted_sum": WeightedSumPolicy(((KeyNormPolicy(), 0.5), (H2OPolicy(), 1.0), (IntentPolicy(), 0.25))),
    "protect_recent": ProtectRecentPolicy(KeyNormPolicy(), recent_tokens=5),
    "protect_sinks": ProtectSinksPolicy(TOVAPolicy(), sink_tokens=3),
}


def _policy(name: str) -> Policy:
    if name in COMPOSED:
        return COMPOSED[name]
    policy = make_policy(name)
    assert policy is not None
    return policy


@pytest.fixture(params=MATRIX_NAMES + list(COMPOSED))
def policy(request: pytest.FixtureRequest) -> Policy:
    return _policy(request.param)


def _permute(view: SpanView, perm: torch.Tensor) -> SpanView:
    """The same tokens in another physical order (query tensors describe the new input: unchanged)."""
    return dataclasses.replace(
        view,
        keys=tuple(k[..., perm, :] for k in view.keys),
        positions=view.positions[perm],
        span_ids=view.span_ids[perm],
        attention=None if view.attention is None else view.attention[perm],
        accumulated_attention=None
        if view.accumulated_attention is None
        else view.accumulated_attention[perm],
    )


# -- the standard matrix -------------------------------------------------------------------------


def test_score_shape_dtype_finite(policy: Policy, view: SpanView) -> None:
    scores = policy.score(view)
    assert scores.shape == (view.num_tokens,)
    assert scores.dtype.is_floating_point
    assert torch.isfinite(scores).all()


def test_deterministic(policy: Policy, view: SpanView) -> None:
    torch.manual_seed(0)
    first = policy.score(view)
    torch.manual_seed(0)
    second = policy.score(view)
    assert torch.equal(first, second)


@pytest.mark.parametrize("keep", [0, 1, N_TOKENS // 4, N_TOKENS, N_TOKENS + 5])
def test_select_returns_k_sorted_unique(policy: Policy, view: SpanView, keep: int) -> None:
    kept = policy.select(view, keep)
    expected = min(keep, view.num_tokens)
    assert kept.numel() == expected
    assert torch.equal(kept, torch.sort(kept).values)
    assert torch.unique(kept).numel() == expected
    if expected:
        assert int(kept.min()) >= 0 and int(kept.max()) < view.num_tokens


def test_protected_tokens_always_kept(policy: Policy, view: SpanView) -> None:
    protected = torch.zeros(view.num_tokens, dtype=torch.bool)
    protected[[3, 17, 29, 41]] = True
    for keep in (4, 10, 30):
        kept = set(policy.select(view, keep, protected=protected).tolist())
        assert {3, 17, 29, 41} <= kept
        assert len(kept) == keep


def test_scores_follow_a_permutation(policy: Policy, view: SpanView) -> None:
    perm = torch.randperm(view.num_tokens, generator=torch.Generator().manual_seed(3))
    expected = policy.score(view)[perm]
    got = policy.score(_permute(view, perm))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # And the same tokens are kept, whatever their physical slots.
    kept = set(view.positions[policy.select(view, 15)].tolist())
    permuted = _permute(view, perm)
    assert set(permuted.positions[policy.select(permuted, 15)].tolist()) == kept


def test_attention_policies_say_so(view: SpanView) -> None:
    bare = dataclasses.replace(
        view, attention=None, accumulated_attention=None, query_keys=None, query_states=None
    )
    for name in MATRIX_NAMES:
        policy = _policy(name)
        if policy.needs_attention and not isinstance(policy, KindPriorPolicy):
            with pytest.raises(ValueError, match="needs view.attention"):
                policy.score(bare)
        elif policy.needs_query:
            with pytest.raises(ValueError, match="query"):
                policy.score(bare)
        else:
            assert torch.isfinite(policy.score(bare)).all()


# -- each policy's own semantics ----------------------------------------------------------------


def _positions(view: SpanView, kept: torch.Tensor) -> set[int]:
    return set(view.positions[kept].tolist())


def test_window_keeps_the_last_k(view: SpanView) -> None:
    assert _positions(view, SlidingWindowPolicy().select(view, 10)) == set(range(50, 60))


def test_streaming_keeps_sinks_and_the_last(view: SpanView) -> None:
    kept = StreamingLLMPolicy(sink_tokens=4).select(view, 14)
    assert _positions(view, kept) == set(range(4)) | set(range(50, 60))


def test_snapkv_keeps_the_observation_window(view: SpanView) -> None:
    policy = SnapKVPolicy(window=QUERY_TOKENS)
    kept = _positions(view, policy.select(view, QUERY_TOKENS + 4))
    assert set(range(N_TOKENS - QUERY_TOKENS, N_TOKENS)) <= kept


@pytest.mark.parametrize("pooling", ["avg", "max"])
def test_snapkv_pools_neighbours_in_logical_order(view: SpanView, pooling: str) -> None:
    attention = torch.full((N_TOKENS,), 0.001)
    attention[20] = 0.5  # one hot token; pooling should bring its neighbours along
    spiky = dataclasses.replace(view, attention=attention)
    policy = SnapKVPolicy(window=4, kernel_size=5, pooling=pooling)  # type: ignore[arg-type]
    kept = _positions(spiky, policy.select(spiky, 4 + 5))
    assert set(range(18, 23)) <= kept
    perm = torch.randperm(N_TOKENS, generator=torch.Generator().manual_seed(5))
    assert _positions(_permute(spiky, perm), policy.select(_permute(spiky, perm), 9)) == kept


def test_h2o_prefers_accumulated_attention(view: SpanView) -> None:
    accumulated = torch.full((N_TOKENS,), 0.01)
    accumulated[[7, 9]] = 1.0
    heavy = dataclasses.replace(view, accumulated_attention=accumulated)
    kept = _positions(heavy, H2OPolicy(recent_tokens=3).select(heavy, 5))
    assert kept == {7, 9, 57, 58, 59}


def test_tova_uses_the_attention_as_given(view: SpanView) -> None:
    assert view.attention is not None
    torch.testing.assert_close(TOVAPolicy().score(view), view.attention)
    assert TOVAPolicy().window == 1


def _handmade_view(keys: torch.Tensor, **extra: object) -> SpanView:
    """A one-layer view over keys `[1, H, n, D]`, one USER span, positions 0..n-1."""
    n = keys.shape[-2]
    return SpanView(
        keys=(keys,),
        positions=torch.arange(n),
        span_ids=torch.zeros(n, dtype=torch.long),
        span_kinds={0: SpanKind.USER},
        sequence_length=n,
        **extra,  # type: ignore[arg-type]
    )


def test_key_norm_prefers_low_norm_keys() -> None:
    gen = torch.Generator().manual_seed(0)
    direction = torch.nn.functional.normalize(torch.randn(1, 2, 12, 16, generator=gen), dim=-1)
    norms = torch.tensor([5.0, 1.0, 4.0, 0.5, 3.0, 2.0, 6.0, 0.1, 7.0, 8.0, 9.0, 10.0])
    view = _handmade_view(direction * norms[None, None, :, None])
    assert _positions(view, KeyNormPolicy().select(view, 3)) == {1, 3, 7}
    assert int(torch.argmax(KeyNormPolicy().score(view))) == 7


def _planted(query_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys `[1, 2, 20, 16]` that are small noise except token 13, aligned with query 1 of every head."""
    gen = torch.Generator().manual_seed(1)
    queries = torch.randn(1, query_heads, 3, 16, generator=gen)  # [B, H_q, m, D]
    keys = 0.1 * torch.randn(1, 2, 20, 16, generator=gen)  # [B, H_kv, n, D]
    group = query_heads // 2
    for h in range(2):
        keys[0, h, 13] = 3.0 * queries[0, h * group : (h + 1) * group, 1].sum(dim=0)
    return queries, keys


@pytest.mark.parametrize("field", ["query_states", "query_keys"])
def test_intent_ranks_the_planted_key_first(field: str) -> None:
    queries, keys = _planted(4 if field == "query_states" else 2)
    view = _handmade_view(keys, **{field: (queries,)})
    assert int(torch.argmax(IntentPolicy().score(view))) == 13
    assert 13 in IntentPolicy().select(view, 1).tolist()


def test_span_relevance_ranks_spans_on_cpu() -> None:
    queries, keys = _planted(4)
    relevant = keys[..., 10:16, :].cpu()  # holds the planted token
    irrelevant = keys[..., 0:6, :].cpu()
    assert span_relevance((queries,), (relevant,)) > span_relevance((queries,), (irrelevant,))
    assert span_relevance((queries,), (keys[..., :0, :],)) == -math.inf
    with pytest.raises(ValueError, match="layers"):
        span_relevance((queries, queries), (relevant,))


def test_lifecycle_ranks_system_over_reasoning() -> None:
    gen = torch.Generator().manual_seed(2)
    keys = torch.randn(1, 2, 10, 16, generator=gen)
    view = SpanView(
        keys=(keys,),
        positions=torch.arange(10),
        span_ids=torch.tensor([0] * 5 + [1] * 5),
        span_kinds={0: SpanKind.SYSTEM, 1: SpanKind.REASONING},
        sequence_length=10,
        attention=torch.full((10,), 0.1),  # equal attention; recency favours the reasoning span
    )
    policy = KindPriorPolicy()
    assert _positions(view, policy.select(view, 5)) == set(range(5))
    spans = policy.span_score(view)
    assert set(spans) == {0, 1} and spans[0] > spans[1]


def test_lifecycle_knobs() -> None:
    assert KindPriorPolicy().needs_attention
    assert not KindPriorPolicy(attention_weight=0.0).needs_attention
    policy = KindPriorPolicy(kind_priors={"tool_result": 0.9})  # type: ignore[dict-item]
    assert policy.kind_priors[SpanKind.TOOL_RESULT] == 0.9
    assert policy.kind_priors[SpanKind.SYSTEM] == 1.0  # defaults fill the rest
    with pytest.raises(ValueError, match="allowed"):
        KindPriorPolicy(kind_priors={"memo": 1.0})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="finite"):
        KindPriorPolicy(recency_weight=math.nan)


def test_composed_wrappers(view: SpanView) -> None:
    mixed = WeightedSumPolicy(((SlidingWindowPolicy(), 1.0), (IntentPolicy(), 0.0)))
    assert mixed.needs_query and not mixed.needs_attention
    assert _positions(view, mixed.select(view, 6)) == set(range(54, 60))
    recent = ProtectRecentPolicy(KeyNormPolicy(), recent_tokens=4)
    assert set(range(56, 60)) <= _positions(view, recent.select(view, 4))
    sinks = ProtectSinksPolicy(SlidingWindowPolicy(), sink_tokens=2)
    assert _positions(view, sinks.select(view, 5)) == {0, 1, 57, 58, 59}
    assert ProtectSinksPolicy(TOVAPolicy()).needs_attention
    # A wrapper reads what its parts read: keys for a key-norm part, H2O's sums for an H2O part.
    assert recent.needs_keys and not sinks.needs_keys
    assert ProtectSinksPolicy(H2OPolicy()).needs_accumulated_attention
    assert WeightedSumPolicy(((H2OPolicy(), 1.0),)).needs_accumulated_attention
    with pytest.raises(ValueError, match="at least one"):
        WeightedSumPolicy(())
    with pytest.raises(TypeError, match="Policy"):
        ProtectRecentPolicy("window")  # type: ignore[arg-type]


# -- factory -------------------------------------------------------------------------------------


def test_factory_builds_every_name() -> None:
    assert make_policy("full") is None
    for name in MATRIX_NAMES:
        assert isinstance(make_policy(name), Policy)
    snap = make_policy("snapkv", {"window": 16, "kernel_size": 7})
    assert isinstance(snap, SnapKVPolicy) and (snap.window, snap.kernel_size) == (16, 7)
    assert policy_params("h2o") == ("recent_ratio", "recent_tokens")


def test_factory_errors_list_what_is_allowed() -> None:
    with pytest.raises(ValueError, match=r"unknown policy 'nope'.*lifecycle.*snapkv"):
        make_policy("nope")
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['windw'\].*allowed.*window"):
        make_policy("snapkv", {"windw": 8})
    with pytest.raises(ValueError, match="allowed: none"):
        make_policy("full", {"window": 8})
    with pytest.raises(ValueError, match="odd"):
        make_policy("snapkv", {"kernel_size": 4})
    with pytest.raises(ValueError, match="int >= 0"):
        make_policy("h2o", {"recent_tokens": -1})
