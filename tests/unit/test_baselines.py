"""Baselines as their papers define them: what each keeps, and which attention signal it reads.

- H2O: heavy hitters by attention *summed* over every query, plus a recent window;
  the budget is split half and half.
- SnapKV: attention of its own observation window (the last `window` queries), pooled.
- TOVA: attention of the last query only.

The first tests hand-build attention patterns where the three signals disagree, so a
policy reading the wrong one keeps the wrong tokens. The later ones run the tiny model
and check that the session probes each policy's own window and that the H2O sum equals
eager attention summed over the queries.
"""

from __future__ import annotations

import copy

import torch
from transformers import DynamicCache, PreTrainedModel

from agentkv import AgentKVConfig, Session, TransformersBackend
from agentkv.policies import (
    AttentionProbe,
    H2OPolicy,
    SnapKVPolicy,
    SpanView,
    TOVAPolicy,
    attention_window,
    needs_accumulated_attention,
)
from agentkv.spans import SpanKind

N = 40


def _view(*, window: torch.Tensor, summed: torch.Tensor, decayed: torch.Tensor | None = None) -> SpanView:
    """A one-span view over N tokens with three attention signals that disagree."""
    return SpanView(
        keys=(torch.zeros(1, 1, N, 4),),
        positions=torch.arange(N),
        span_ids=torch.zeros(N, dtype=torch.long),
        span_kinds={0: SpanKind.USER},
        sequence_length=N,
        attention=window,
        accumulated_attention=summed,
        decayed_attention=decayed,
    )


def _spikes(at: list[int], base: float = 0.001) -> torch.Tensor:
    out = torch.full((N,), base)
    out[at] = 1.0
    return out


def _kept(view: SpanView, chosen: torch.Tensor) -> set[int]:
    return set(view.positions[chosen].tolist())


def test_h2o_splits_the_budget_between_heavy_hitters_and_recent_tokens() -> None:
    view = _view(window=_spikes([20, 21, 22, 23]), summed=_spikes([3, 7, 9, 11, 13, 15]))
    kept = _kept(view, H2OPolicy().select(view, 8))
    # Half the budget is the 4 most recent tokens, the other half the heaviest summed-attention hitters.
    assert {36, 37, 38, 39} <= kept
    assert len(kept & {3, 7, 9, 11, 13, 15}) == 4
    assert not kept & {20, 21, 22, 23}  # the window signal is not H2O's


def test_h2o_recent_ratio_moves_the_split() -> None:
    view = _view(window=_spikes([]), summed=_spikes([3, 7, 9, 11, 13, 15, 17, 19]))
    kept = _kept(view, H2OPolicy(recent_ratio=0.25).select(view, 8))
    assert {38, 39} <= kept
    assert len(kept & {3, 7, 9, 11, 13, 15, 17, 19}) == 6
    only_heavy = _kept(view, H2OPolicy(recent_ratio=0.0).select(view, 8))
    assert only_heavy == {3, 7, 9, 11, 13, 15, 17, 19}


def test_h2o_declares_that_it_needs_the_summed_signal() -> None:
    assert needs_accumulated_attention(H2OPolicy())
    assert not needs_accumulated_attention(SnapKVPolicy())
    assert not needs_accumulated_attention(TOVAPolicy())


def test_snapkv_keeps_what_its_window_attends_not_the_accumulated_sum() -> None:
    view = _view(window=_spikes([12]), summed=_spikes([3]), decayed=_spikes([5]))
    kept = _kept(view, SnapKVPolicy(window=4, kernel_size=5).select(view, 4 + 5))
    assert set(range(36, 40)) <= kept  # the observation window itself
    assert set(range(10, 15)) <= kept  # the attended token and its pooled neighbours
    assert 3 not in kept
    assert 5 not in kept


def test_tova_keeps_what_the_last_query_attends() -> None:
    view = _view(window=_spikes([4, 30]), summed=_spikes([8, 9]))
    assert _kept(view, TOVAPolicy().select(view, 2)) == {4, 30}


def test_each_baseline_asks_for_its_own_observation_window() -> None:
    assert attention_window(SnapKVPolicy(window=7)) == 7
    assert attention_window(TOVAPolicy()) == 1
    assert attention_window(H2OPolicy(), default=32) == 32


def _eager_attention(model: PreTrainedModel, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, eager attention probabilities `[B, H, T, T]` of one forward over `ids`."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        out = eager(input_ids=ids, output_attentions=True)
    return list(out.attentions)


def test_heavy_probe_sums_every_query_across_chunks(tiny_model: PreTrainedModel) -> None:
    ids = torch.randint(3, 512, (1, 30), generator=torch.Generator().manual_seed(3))
    eager = _eager_attention(tiny_model, ids)
    expected = torch.stack([a.sum(dim=2).mean(dim=(0, 1)) for a in eager]).mean(dim=0)  # [T]
    cache = DynamicCache(config=tiny_model.config)
    with torch.no_grad(), AttentionProbe(tiny_model, window=2, heavy=True) as probe:
        tiny_model(input_ids=ids[:, :18], cache=cache, use_cache=True)
        tiny_model(
            input_ids=ids[:, 18:], cache=cache, use_cache=True, position_ids=torch.arange(18, 30)[None]
        )
        heavy = probe.heavy_attention()
        window = probe.attention()
    torch.testing.assert_close(heavy, expected.float(), atol=1e-5, rtol=1e-4)
    assert abs(float(heavy.sum()) - 30.0) < 1e-3  # each of the 30 queries contributes 1
    # The window signal is only the last 2 queries of the last forward.
    last_two = torch.stack([a[:, :, -2:, :].mean(dim=(0, 1, 2)) for a in eager]).mean(dim=0)
    torch.testing.assert_close(window, last_two.float(), atol=1e-5, rtol=1e-4)


HISTORY = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "The secret code is 4417. Remember the package tracking number ZX-99."},
    {"role": "assistant", "content": "Noted: code 4417 and tracking number ZX-99."},
    {"role": "user", "content": "What is the weather in Paris today and tomorrow?"},
]


def _session(
    model: PreTrainedModel, tokenizer: object, policy: dict[str, object], **budget: object
) -> Session:
    """A one-session backend with `policy` (and a budget when given)."""
    config = AgentKVConfig.from_dict({"policy": policy, "budget": budget} if budget else {"policy": policy})
    return TransformersBackend(model, tokenizer, config).session("t")


def _probe_all(model: PreTrainedModel, ids: list[int], window: int) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad(), AttentionProbe(model, window=window, heavy=True) as probe:
        model(input_ids=torch.tensor([ids]), cache=DynamicCache(config=model.config), use_cache=True)
    return probe.attention(), probe.heavy_attention()


def test_session_probes_snapkv_with_its_own_window(tiny_model, tiny_tokenizer) -> None:
    session = _session(tiny_model, tiny_tokenizer, {"name": "snapkv", "window": 3})
    session.extend(HISTORY)  # one prefill: the last 3 queries are the conversation's last 3 tokens
    tokens = session.store.attended_tokens(None, keys=False, queries=False)  # every slot, in slot order
    assert tokens is not None and tokens.offsets.numel() == len(session.token_ids())
    window, _ = _probe_all(tiny_model, session.token_ids(), 3)
    torch.testing.assert_close(tokens.attention, window, atol=1e-5, rtol=1e-4)


def test_session_sums_attention_for_h2o(tiny_model, tiny_tokenizer) -> None:
    session = _session(tiny_model, tiny_tokenizer, {"name": "h2o"})
    session.extend(HISTORY)
    tokens = session.store.attended_tokens(None, keys=False, queries=False)  # every slot, in slot order
    assert tokens is not None and tokens.offsets.numel() == len(session.token_ids())
    _, heavy = _probe_all(tiny_model, session.token_ids(), 1)
    torch.testing.assert_close(tokens.accumulated_attention, heavy, atol=1e-5, rtol=1e-4)


def test_token_mode_keeps_up_to_the_high_watermark(tiny_model, tiny_tokenizer) -> None:
    """Generic compressors hold a cache of the budget's size, the room recall gets for agentkv."""
    budget = {"device_tokens": 24, "high_watermark": 1.0, "low_watermark": 0.5}
    for name in ("window", "h2o", "snapkv", "tova"):
        session = _session(tiny_model, tiny_tokenizer, {"name": name}, **budget)
        session.extend(HISTORY)
        assert session.stats().attended_tokens == 24, name
