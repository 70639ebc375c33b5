"""AttentionProbe: hooks always come off, and the recomputed window attention equals eager attention."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from transformers import AttentionInterface, DynamicCache, LlamaConfig, LlamaForCausalLM, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from agentkv.policies import (
    AttentionProbe,
    H2OPolicy,
    KeyNormPolicy,
    ProtectRecentPolicy,
    SnapKVPolicy,
    TOVAPolicy,
    WeightedSumPolicy,
    attention_modules,
    attention_window,
)
from agentkv.policies.attention_call import PROBE_PREFIX, registered_names
from agentkv.store.cache import ManagedCache

WINDOW = 8
TOL = 1e-5


def _variant(model: PreTrainedModel, **overrides: object) -> PreTrainedModel:
    """A fresh random tiny Llama like the fixture's, with some config fields changed."""
    values = model.config.to_dict()
    values.update(overrides)
    config = LlamaConfig(**values)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def _eager_copy(model: PreTrainedModel) -> PreTrainedModel:
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    return eager


def _eager_window_attention(
    model: PreTrainedModel, ids: torch.Tensor, prefix: int, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """`[S]` eager attention of the last WINDOW rows of the second forward, mean over heads/rows/layers."""
    eager = _eager_copy(model)
    cache = DynamicCache(config=eager.config)
    with torch.no_grad():
        if prefix:
            eager(input_ids=ids[:, :prefix], cache=cache, use_cache=True)
        out = eager(
            input_ids=ids[:, prefix:],
            cache=cache,
            use_cache=True,
            output_attentions=True,
            attention_mask=mask,
        )
    rows = [a[..., -WINDOW:, :].float().mean(dim=(0, 1, 2)) for a in out.attentions]  # each [S]
    return torch.stack(rows).mean(dim=0)


def _probe_attention(model: PreTrainedModel, ids: torch.Tensor, prefix: int, **kwargs: Any) -> torch.Tensor:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        if prefix:
            model(input_ids=ids[:, :prefix], cache=cache, use_cache=True)
        with AttentionProbe(model, WINDOW) as probe:
            model(input_ids=ids[:, prefix:], cache=cache, use_cache=True, **kwargs)
    return probe.attention()


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(7))


def _assert_restored(model: PreTrainedModel, kernel: str = "sdpa") -> None:
    """The model runs its own kernel again and transformers holds no probe registration."""
    assert model.config._attn_implementation == kernel
    assert all(m.config._attn_implementation == kernel for m in attention_modules(model))
    assert registered_names() == []
    assert not [name for name in AttentionInterface._global_mapping if name.startswith(PROBE_PREFIX)]
    assert not [name for name in AttentionMaskInterface._global_mapping if name.startswith(PROBE_PREFIX)]


# -- hooks ---------------------------------------------------------------------------------------


def test_hook_count_returns_to_zero(tiny_model: PreTrainedModel, ids: torch.Tensor) -> None:
    probe = AttentionProbe(tiny_model, WINDOW)
    assert probe.hook_count == 0
    with probe:
        assert probe.hook_count == tiny_model.config.num_hidden_layers
        with torch.no_grad():
            tiny_model(input_ids=ids)
    assert probe.hook_count == 0
    _assert_restored(tiny_model)


def test_hook_count_returns_to_zero_after_exception(tiny_model: PreTrainedModel, ids: torch.Tensor) -> None:
    probe = AttentionProbe(tiny_model, WINDOW)
    with pytest.raises(RuntimeError, match="boom"), probe:
        with torch.no_grad():
            tiny_model(input_ids=ids)
        raise RuntimeError("boom")
    assert probe.hook_count == 0
    _assert_restored(tiny_model)
    # The probe can be used again afterwards.
    with probe, torch.no_grad():
        tiny_model(input_ids=ids)
    assert probe.hook_count == 0
    assert probe.attention().shape == (ids.shape[1],)


def test_probe_is_not_reentrant(tiny_model: PreTrainedModel) -> None:
    probe = AttentionProbe(tiny_model, WINDOW)
    with probe, pytest.raises(RuntimeError, match="already attached"):
        probe.__enter__()
    assert probe.hook_count == 0


def test_invalid_window_and_empty_results(tiny_model: PreTrainedModel) -> None:
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="window"):
            AttentionProbe(tiny_model, bad)  # type: ignore[arg-type]
    with AttentionProbe(tiny_model, WINDOW) as probe:
        pass
    with pytest.raises(RuntimeError, match="no forward"):
        probe.attention()
    with pytest.raises(ValueError, match="no attention module"):
        AttentionProbe(torch.nn.Linear(2, 2), WINDOW).__enter__()


# -- numerics ------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", [0, 30], ids=["prefill", "over-cache"])
def test_matches_eager_attention(tiny_model: PreTrainedModel, ids: torch.Tensor, prefix: int) -> None:
    expected = _eager_window_attention(tiny_model, ids, prefix)
    got = _probe_attention(tiny_model, ids, prefix)
    assert got.dtype == torch.float32 and got.device.type == "cpu"
    assert got.shape == (ids.shape[1],)
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)
    assert got.sum().item() == pytest.approx(1.0, abs=1e-5)


def test_matches_eager_when_probing_the_eager_model(tiny_model: PreTrainedModel, ids: torch.Tensor) -> None:
    """The eager path hands the hook a float 4D mask; the probe must use it the same way."""
    expected = _eager_window_attention(tiny_model, ids, 30)
    got = _probe_attention(_eager_copy(tiny_model), ids, 30)
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)


def test_without_cache_recomputes_keys(tiny_model: PreTrainedModel, ids: torch.Tensor) -> None:
    expected = _eager_window_attention(tiny_model, ids, 0)
    with AttentionProbe(tiny_model, WINDOW) as probe, torch.no_grad():
        tiny_model(input_ids=ids, use_cache=False)
    torch.testing.assert_close(probe.attention(), expected, atol=TOL, rtol=0)


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa2", "mqa"])
def test_gqa(tiny_model: PreTrainedModel, ids: torch.Tensor, kv_heads: int) -> None:
    model = _variant(tiny_model, num_attention_heads=4, num_key_value_heads=kv_heads)
    expected = _eager_window_attention(model, ids, 30)
    got = _probe_attention(model, ids, 30)
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)


def test_q_norm_models(ids: torch.Tensor) -> None:
    """Qwen3 normalises queries per head before RoPE; the probe must too."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval().requires_grad_(False)
    with torch.no_grad():  # make q_norm matter: a non-trivial weight
        for module in attention_modules(model):
            module.q_norm.weight.uniform_(0.5, 1.5)  # type: ignore[union-attr, operator]
    expected = _eager_window_attention(model, ids, 30)
    got = _probe_attention(model, ids, 30)
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)


def test_custom_bool_mask_is_honoured(tiny_model: PreTrainedModel, ids: torch.Tensor) -> None:
    """A logical 4D mask (rehydration, branches) hides slots; the probe must hide them too."""
    new = ids.shape[1] - 30
    slots = torch.arange(ids.shape[1])
    mask = slots[None, :] <= (slots[-new:])[:, None]  # [new, S] causal
    mask[:, 5:12] = False  # pretend slots 5..11 belong to a sibling branch
    mask = mask[None, None]  # [1, 1, new, S]
    # Eager attention *adds* a custom 4D mask, so it needs the additive form (a bool one
    # would silently become a +1 bias); SDPA takes the bool form.
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    expected = _eager_window_attention(tiny_model, ids, 30, mask=additive)
    got = _probe_attention(tiny_model, ids, 30, attention_mask=mask)
    assert got[5:12].abs().max() < 1e-7
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)


def test_shared_prefix_cache_uses_full(tiny_model: PreTrainedModel, ids: torch.Tensor) -> None:
    """With our ManagedCache the prefix lives outside `.keys`: the probe must read `.full()`."""
    expected = _eager_window_attention(tiny_model, ids, 30)
    cache = ManagedCache(tiny_model.config.num_hidden_layers)
    with torch.no_grad():
        tiny_model(input_ids=ids[:, :30], cache=cache, use_cache=True)
        for layer in cache.managed_layers:
            layer.freeze_as_prefix()
        with AttentionProbe(tiny_model, WINDOW) as probe:
            tiny_model(
                input_ids=ids[:, 30:],
                position_ids=torch.arange(30, ids.shape[1])[None],
                cache=cache,
                use_cache=True,
            )
    torch.testing.assert_close(probe.attention(), expected, atol=TOL, rtol=0)


def test_keeps_queries_only_when_asked(tiny_model: PreTrainedModel, ids: torch.Tensor) -> None:
    with AttentionProbe(tiny_model, WINDOW) as plain, torch.no_grad():
        tiny_model(input_ids=ids)
    assert plain.query_states is None
    with AttentionProbe(tiny_model, WINDOW, keep_queries=True) as probe, torch.no_grad():
        tiny_model(input_ids=ids)
    queries = probe.query_states
    assert queries is not None and len(queries) == tiny_model.config.num_hidden_layers
    assert all(q.shape == (1, 4, WINDOW, 16) for q in queries)  # [B, H_q, W, D]
    assert len(probe.layer_attention) == tiny_model.config.num_hidden_layers


def test_short_forward_uses_its_own_tokens(tiny_model: PreTrainedModel, ids: torch.Tensor) -> None:
    """A decode step (1 token) is a window of 1, whatever the probe's window."""
    cache = DynamicCache(config=tiny_model.config)
    with torch.no_grad():
        tiny_model(input_ids=ids[:, :-1], cache=cache, use_cache=True)
        with AttentionProbe(tiny_model, WINDOW, keep_queries=True) as probe:
            tiny_model(input_ids=ids[:, -1:], cache=cache, use_cache=True)
    assert probe.query_states is not None and probe.query_states[0].shape[-2] == 1
    assert probe.attention().shape == (ids.shape[1],)


def test_attention_window_reads_policies() -> None:
    assert attention_window(None) == 32
    assert attention_window(KeyNormPolicy(), default=16) == 16
    assert attention_window(TOVAPolicy()) == 1
    assert attention_window(SnapKVPolicy(window=12)) == 12
    assert attention_window(ProtectRecentPolicy(TOVAPolicy(), recent_tokens=4)) == 1
    composed = WeightedSumPolicy(((TOVAPolicy(), 1.0), (SnapKVPolicy(window=24), 1.0), (H2OPolicy(), 0.5)))
    assert attention_window(composed) == 24


def test_a_second_probe_on_the_same_model_is_refused(tiny_model: PreTrainedModel, ids: torch.Tensor) -> None:
    with AttentionProbe(tiny_model, WINDOW), pytest.raises(RuntimeError, match="already routed"):
        AttentionProbe(tiny_model, WINDOW).__enter__()
    _assert_restored(tiny_model)


def test_eager_models_get_eager_back_and_other_models_are_untouched(
    tiny_model: PreTrainedModel, ids: torch.Tensor
) -> None:
    """Routing is per model: another model runs its own kernel, unprobed, while one is routed."""
    eager = _eager_copy(tiny_model)
    with torch.no_grad():
        before = tiny_model(input_ids=ids).logits
        with AttentionProbe(eager, WINDOW) as probe:
            during = tiny_model(input_ids=ids).logits
            assert tiny_model.config._attn_implementation == "sdpa"
        assert not probe.layer_attention  # the other model's forward was not recorded
    assert torch.equal(before, during)
    _assert_restored(eager, "eager")
    _assert_restored(tiny_model)
