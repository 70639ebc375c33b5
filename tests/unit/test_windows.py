"""Sliding-window and hybrid layers: every move keeps each layer's window as a plain forward has it.

transformers sizes a sliding window by physical slots; agentkv's cache holds tokens
out of logical order after an archive + restore, an evict + rehydrate or a recall.
Each case here encodes a conversation several windows long on a tiny windowed model,
moves a long tool result, and compares the logits of the next tokens with a plain
forward over the same ids (nothing evicted: they must agree to fp32 tolerance).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import transformers

from agentkv import AgentKVConfig, Custom, TransformersBackend
from agentkv.backend import calibration
from agentkv.backend.masks import FULL, SLIDING, AttentionLayout, allowed_keys, logical_masks
from agentkv.config_sections import QuantizationConfig
from agentkv.spans import SpanKind
from tests.unit.session_history import forcing
from tests.unit.window_models import (
    FULL_CASES,
    HISTORY,
    MOVES,
    RULES,
    VARIANTS,
    WINDOW,
    WINDOWED_CASES,
    archive_restore,
    build_case,
    case_params,
    logit_delta,
    open_session,
    plain_logits,
)

TOL = 1e-5


def assert_plain(session: Any, model: torch.nn.Module, what: str) -> None:
    """The next tokens' logits over the session's cache equal a plain forward over its ids."""
    delta = logit_delta(session, model)
    assert delta <= TOL, f"{what}: logits off by {delta}"
    session.check()


@pytest.mark.parametrize("move", list(MOVES))
@pytest.mark.parametrize("case", case_params(WINDOWED_CASES + FULL_CASES))
def test_a_moved_span_keeps_every_layers_window(case: str, move: str, tiny_tokenizer: Any) -> None:
    model = build_case(case)
    session = open_session(model, tiny_tokenizer)
    assert_plain(session, model, f"{case}: nothing moved")
    MOVES[move](session)  # the moved span now sits after later messages in the physical cache
    assert_plain(session, model, f"{case} after {move}")


@pytest.mark.parametrize("case", case_params(WINDOWED_CASES))
def test_greedy_decode_after_a_restore_equals_a_plain_greedy_loop(case: str, tiny_tokenizer: Any) -> None:
    model = build_case(case)
    session = open_session(model, tiny_tokenizer)
    archive_restore(session)
    chat = session.backend.chat_format
    prompt = session.token_ids() + chat.generation_prompt_ids(session.messages)
    session.generate(max_new_tokens=6)
    produced = session.spans[-1].token_ids[len(chat.generation_prompt_ids(session.messages[:-1])) :]
    stop_ids = chat.stop_token_ids()
    expected: list[int] = []
    for _ in range(6):
        token = int(plain_logits(model, prompt + expected)[-1].argmax())
        if token in stop_ids:
            break
        expected.append(token)
    assert produced[: len(expected)] == expected


@pytest.mark.parametrize("case", case_params(list(VARIANTS)))
def test_windowed_variants_meet_a_budget_over_turns(case: str, tiny_tokenizer: Any) -> None:
    """The default policy under a 64-token budget on the variants the family matrix lacks.

    Sliding layers are charged only for the slots they can still attend, so a windowed
    model may meet the budget without demoting anything.
    """
    model = build_case(case)
    session = TransformersBackend(
        model, tiny_tokenizer, AgentKVConfig.from_dict({"budget": {"device_tokens": 64}})
    ).session("t")
    messages: list[dict[str, Any]] = [HISTORY[0]]
    for words in (
        "The secret code is 4417. Remember the package tracking number ZX-99.",
        "search results: lorem ipsum dolor sit amet, consectetur adipiscing elit",
        "the user asked about the weather in Paris and the tool returned sunny skies",
        "And the code?",
    ):
        messages.append({"role": "user", "content": words})
        session.extend(messages)
        messages.append({"role": "assistant", "content": session.generate(max_new_tokens=4)})
        session.check()  # bytes charged = bytes held, per tier
        assert session.stats().budget_satisfied, session.stats()


def test_the_layout_is_read_from_the_config() -> None:
    mistral = AttentionLayout.of(build_case("mistral").config)
    assert mistral.layer_types == (SLIDING,) * 4 and mistral.sliding_window == WINDOW
    gemma3 = AttentionLayout.of(build_case("gemma3").config)
    assert gemma3.types == (FULL, SLIDING) and gemma3.layers_of(FULL) == [3]
    llama = AttentionLayout.of(build_case("llama").config)
    assert not llama.windowed and llama.types == (FULL,)


def test_the_window_counts_logical_positions_not_slots() -> None:
    layout = AttentionLayout((SLIDING, FULL), 3)
    keys = torch.tensor([0, 1, 2, 7, 8, 3, 4, 9])  # a span (3, 4) restored after later tokens
    queries = torch.tensor([9])
    masks = logical_masks(layout, keys, queries, implementation="sdpa", dtype=torch.float32)
    assert isinstance(masks, dict)
    assert masks[FULL][0, 0, 0].tolist() == [True] * 8
    assert masks[SLIDING][0, 0, 0].tolist() == [False, False, False, True, True, False, False, True]
    eager = logical_masks(layout, keys, queries, implementation="eager", dtype=torch.float32)
    assert isinstance(eager, dict)
    assert torch.equal(eager[SLIDING][0, 0] == 0, allowed_keys(keys, queries, 3))
    with pytest.raises(ValueError, match="flash_attention_2.*cannot take a logical 4D mask"):
        logical_masks(layout, keys, queries, implementation="flash_attention_2", dtype=torch.float32)


def test_an_unknown_layer_type_is_refused() -> None:
    config = copy.deepcopy(build_case("gemma3").config)
    config.layer_types = ["chunked_attention"] * 4
    with pytest.raises(ValueError, match="chunked_attention.*allowed"):
        AttentionLayout.of(config)


ALIBI_MODELS = {
    "bloom": lambda: transformers.BloomForCausalLM(
        transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4)
    ),
    "mpt": lambda: transformers.MptForCausalLM(
        transformers.MptConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=128)
    ),
    "falcon": lambda: transformers.FalconForCausalLM(
        transformers.FalconConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True
        )
    ),
}


@pytest.mark.parametrize("name", sorted(ALIBI_MODELS))
def test_a_model_with_alibi_biases_is_refused_before_any_session(name: str, tiny_tokenizer) -> None:
    """ALiBi reads slot order, not the fed positions: a restored span would change the logits."""
    with pytest.raises(ValueError, match="ALiBi"):
        TransformersBackend(ALIBI_MODELS[name]().eval(), tiny_tokenizer, AgentKVConfig())


def test_falcon_with_rotary_positions_is_accepted(tiny_tokenizer) -> None:
    config = transformers.FalconConfig(
        vocab_size=len(tiny_tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4
    )
    model = transformers.FalconForCausalLM(config).eval()
    session = TransformersBackend(model, tiny_tokenizer, AgentKVConfig()).session("t")
    assert session.extend([{"role": "user", "content": "hi"}]).prefilled_tokens > 0


@pytest.mark.parametrize("case", ["gemma3", "mistral", "llama"])
def test_calibration_runs_on_agentkvs_cache_with_each_layers_window(
    case: str, tiny_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Quantization read back as the identity: every rung but the drop costs exactly nothing
    # when each rung's forward sees the same cache and masks as the reference's.
    monkeypatch.setattr(calibration, "round_trip_keys", lambda k, bits, group: k)
    monkeypatch.setattr(calibration, "round_trip_values", lambda v, bits, group: v)
    costs = calibration.measure_rung_costs(build_case(case), tiny_tokenizer, QuantizationConfig())
    assert costs.kl["dropped"] > 0
    for rung in ("keys8", "attended_q", "archive8", "archive4"):
        assert abs(costs.kl[rung]) <= 1e-6, f"{case}: {rung} costs {costs.kl[rung]} with lossless codes"


def _token_bytes(model: torch.nn.Module) -> int:
    """Bytes one token's keys and values take in one layer (fp32)."""
    config: Any = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * int(kv_heads) * int(head_dim) * 4


@pytest.mark.parametrize("case", case_params(["gemma3", "mistral", "qwen2-window", "llama"]))
def test_sliding_layers_hold_and_charge_only_what_they_can_attend(case: str, tiny_tokenizer: Any) -> None:
    """Full layers hold every token, sliding layers the last window - 1 (as HF's hybrid cache)."""
    model = build_case(case)
    layout = AttentionLayout.of(model.config)
    full, sliding = len(layout.layers_of(FULL)), len(layout.layers_of(SLIDING))
    per = _token_bytes(model)
    session = open_session(model, tiny_tokenizer)
    tokens = len(session.token_ids())
    held = min(tokens, WINDOW - 1)
    assert session.stats().device_bytes == (full * tokens + sliding * held) * per
    session.check()  # the walk over the tensors agrees with the product
    # An old span is dead on the sliding layers: archived, it takes only its full layers' bytes.
    (tool,) = [s for s in session.spans if s.kind is SpanKind.TOOL_RESULT]
    assert session.apply(Custom(event="archive", owner="call_1")).applied
    assert session.stats().host_bytes == full * tool.length * per
    assert session.stats().device_bytes == (full * (tokens - tool.length) + sliding * held) * per
    assert session.apply(Custom(event="bring", owner="call_1")).applied
    assert_plain(session, model, f"{case}: restored")


@pytest.mark.parametrize("case", case_params(["gemma3", "mistral", "qwen2-window"]))
def test_a_fork_a_shared_prefix_and_a_rewrite_keep_each_layers_window(case: str, tiny_tokenizer: Any) -> None:
    model = build_case(case)
    system = {"role": "system", "content": "You are a helpful assistant who reads manifests. " * 4}
    history = [system, *HISTORY[1:]]
    config = AgentKVConfig.from_dict({"rules": RULES, "prefix_cache": {"enabled": True}})
    backend = TransformersBackend(model, tiny_tokenizer, config)
    first = backend.session("a")
    first.extend(history)
    assert_plain(first, model, f"{case}: first thread")
    second = backend.session("b")  # starts from the first thread's shared system prefix
    second.extend([*history[:-1], {"role": "user", "content": "and what is the tracking number?"}])
    assert second.stats().shared_prefix_tokens > 2 * WINDOW
    assert_plain(second, model, f"{case}: from a shared prefix")
    branch = backend.fork("a", "b1")
    branch.extend([*history, {"role": "user", "content": "a branch question about the skies"}])
    assert_plain(branch, model, f"{case}: a branch")
    assert_plain(first, model, f"{case}: the parent after its branch moved on")
    # A rewrite: the last message replaced; the new one attends a window that was dropped.
    first.extend([*history[:-1], {"role": "user", "content": "forget that; what was the weather?"}])
    assert_plain(first, model, f"{case}: after a rewrite")


@pytest.mark.parametrize("case", case_params(["gemma3", "qwen2-window", "llama"]))
def test_policies_score_keys_only_from_layers_that_hold_every_token(case: str, tiny_tokenizer: Any) -> None:
    """Behind a sliding window a layer holds no key (its slot reads zeros): policies read the full layers."""
    model = build_case(case)
    layout = AttentionLayout.of(model.config)
    session = open_session(model, tiny_tokenizer)
    assert len(session.token_ids()) > 2 * WINDOW  # the oldest tokens are behind every sliding window
    view = session.scoring_view()
    assert len(view.keys) == len(layout.layers_of(FULL)) and view.query_keys is not None
    assert len(view.query_keys) == len(view.keys)
    for layer_keys in view.keys:  # [B, H, n, D]: every token's key is a real one
        assert bool(layer_keys.abs().amax(dim=(0, 1, 3)).gt(0).all())


@pytest.mark.parametrize("case", case_params(["gemma3", "mistral"]))
def test_an_answer_cut_at_a_stop_string_keeps_every_layers_window(case: str, tiny_tokenizer: Any) -> None:
    """The stop string's tokens leave the cache after the sliding layers trimmed for them: still exact."""
    model = build_case(case)
    session = open_session(model, tiny_tokenizer)
    said = tiny_tokenizer.encode(
        "it is raining hard now STOP and " + "more words " * WINDOW, add_special_tokens=False
    )
    text = session.generate(max_new_tokens=len(said), stop=["STOP"], logits_processor=forcing(said))
    assert text and "STOP" not in text and "STOP" not in tiny_tokenizer.decode(session.token_ids())
    assert_plain(session, model, f"{case}: after a stop string")
