"""Sessions that never re-encode: reuse, exactness of the managed cache, decoding, bad input."""

from __future__ import annotations

import logging

import pytest
import torch

from agentkv import AgentKVConfig, Custom, TransformersBackend, UnknownSessionError
from agentkv.spans import SpanState, Tier
from tests.unit.session_history import HISTORY, TOL, forcing
from tests.unit.store_moves import archive, restore


@pytest.fixture()
def backend(tiny_model, tiny_tokenizer) -> TransformersBackend:
    return TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig.from_dict({"policy": "full"}))


def full_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float()  # [n, V]


def assert_matches_full(session, model, probe: list[int]) -> float:
    """Continuation logits over the managed cache equal a plain forward of all tokens."""
    managed = session.continuation_logits(probe)
    reference = full_logits(model, session.token_ids() + probe)[-len(probe) :]
    delta = (managed - reference).abs().max().item()
    assert delta <= TOL, delta
    return delta


def test_extend_logits_equal_full_forward(backend, tiny_model):
    session = backend.session("t")
    result = session.extend(HISTORY)
    assert result.prefilled_tokens == len(session.token_ids())
    reference = full_logits(tiny_model, session.token_ids())[-1]
    assert (session.last_logits - reference).abs().max().item() <= TOL
    assert_matches_full(session, tiny_model, [5, 6, 7])
    session.check()


def test_same_history_twice_prefills_nothing(backend):
    session = backend.session("t")
    first = session.extend(HISTORY)
    second = session.extend(HISTORY)
    assert first.prefilled_tokens > 0
    assert second.prefilled_tokens == 0
    assert second.reused_tokens == first.prefilled_tokens
    stats = session.stats()
    assert stats.prefill_tokens == first.prefilled_tokens
    assert stats.reused_tokens == first.prefilled_tokens


def test_appending_encodes_only_new_messages(backend):
    session = backend.session("t")
    session.extend(HISTORY[:3])
    before = len(session.token_ids())
    result = session.extend(HISTORY)
    assert result.reused_tokens == before
    assert result.prefilled_tokens == len(session.token_ids()) - before


def test_rewritten_middle_message_reencodes_from_first_changed_token(backend, tiny_model):
    session = backend.session("t")
    session.extend(HISTORY)
    ids_before = session.token_ids()
    rewritten = [dict(m) for m in HISTORY]
    rewritten[3]["content"] = "What is the weather in Rome?"
    result = session.extend(rewritten)
    ids_after = session.token_ids()
    common = next(i for i, (a, b) in enumerate(zip(ids_before, ids_after, strict=False)) if a != b)
    assert result.first_changed_message == 3
    assert result.prefilled_tokens == len(ids_after) - common
    assert result.reused_tokens == common
    reference = full_logits(tiny_model, ids_after)[-1]
    assert (session.last_logits - reference).abs().max().item() <= TOL
    assert_matches_full(session, tiny_model, [9, 10])
    session.check()


def test_shorter_history_crops_the_tail(backend, tiny_model):
    session = backend.session("t")
    session.extend(HISTORY)
    result = session.extend(HISTORY[:4])
    assert result.prefilled_tokens == 0
    assert result.cropped_tokens > 0
    assert_matches_full(session, tiny_model, [3, 4])
    session.check()


@pytest.mark.parametrize("span_index", [0, 1, 3, 5])
def test_offload_and_restore_any_span_is_exact(backend, tiny_model, span_index):
    session = backend.session("t")
    session.extend(HISTORY)
    span = session.spans[span_index]
    device_before = session.stats().device_bytes
    archive(session.store, span, "host")
    assert span.tier is Tier.HOST
    stats = session.stats()
    assert stats.host_bytes == span.length * session.runner.bytes_per_token
    assert stats.device_bytes == device_before - stats.host_bytes
    restore(session.store, [span])
    assert span.tier is Tier.DEVICE
    assert session.stats().host_bytes == 0
    assert_matches_full(session, tiny_model, [21, 22])
    session.check()


def test_int8_restore_is_close(backend, tiny_model):
    session = backend.session("t")
    session.extend(HISTORY)
    probe = [21, 22, 23]
    exact = session.continuation_logits(probe)
    span = session.spans[5]
    archive(session.store, span, "int8")
    assert session.stats().quantized_bytes > 0
    restore(session.store, [span])
    approx = session.continuation_logits(probe)
    # int8 KIVI on a random tiny model: logits move by well under 1% of their spread.
    spread = exact.abs().max().item()
    assert (approx - exact).abs().max().item() <= 0.01 * spread


def test_greedy_generate_matches_model_generate(backend, tiny_model):
    session = backend.session("t")
    session.extend(HISTORY)
    prompt = session.token_ids() + backend.chat_format.generation_prompt_ids(session.messages)
    text = session.generate(max_new_tokens=12)
    span = session.spans[-1]
    produced = span.token_ids[len(backend.chat_format.generation_prompt_ids(session.messages[:-1])) :]
    with torch.inference_mode():
        reference = tiny_model.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
    suffix = backend.chat_format.assistant_suffix_ids()
    produced = produced[: len(produced) - len(suffix)]
    stop_ids = backend.chat_format.stop_token_ids()
    expected = []
    for token in reference:
        if token in stop_ids:
            break
        expected.append(token)
    assert produced == expected
    assert text == backend.tokenizer.decode(expected, skip_special_tokens=True)


def test_generated_answer_is_reused_next_turn(backend, tiny_model):
    session = backend.session("t")
    session.extend(HISTORY)
    text = session.generate(max_new_tokens=8)
    logical_before = len(session.token_ids())
    result = session.extend(
        [*HISTORY, {"role": "assistant", "content": text}, {"role": "user", "content": "ok"}]
    )
    assert result.first_changed_message is None
    suffix = len(backend.chat_format.assistant_suffix_ids())
    new_user = len(session.spans[-1].token_ids)
    # Only the pending tail of the answer (the template's end-of-turn, and the last sampled token) is new.
    assert result.prefilled_tokens <= suffix + 1 + new_user
    assert result.reused_tokens >= logical_before - suffix - 1
    reference = full_logits(tiny_model, session.token_ids())[-1]
    assert (session.last_logits - reference).abs().max().item() <= TOL
    session.check()


def test_stream_equals_generate_and_prefix_is_excluded(backend):
    a = backend.session("a")
    b = backend.session("b")
    a.extend(HISTORY)
    b.extend(HISTORY)
    pieces = list(a.stream(max_new_tokens=10, prefix="The code is"))
    text = b.generate(max_new_tokens=10, prefix="The code is")
    assert "".join(pieces) == text
    assert not text.startswith("The code is")
    assert a.messages[-1].content == "The code is" + text


def test_stop_strings_cut_the_answer(backend):
    session = backend.session("t")
    session.extend(HISTORY)
    full = session.generate(max_new_tokens=16)
    if len(full) < 3:
        pytest.skip("the random model answered too briefly to pick a stop string")
    stop = full[2:4]
    other = backend.session("u")
    other.extend(HISTORY)
    cut = other.generate(max_new_tokens=16, stop=[stop])
    assert stop not in cut
    assert full.startswith(cut)


def test_a_stop_string_stays_out_of_the_history_and_the_cache(backend, tiny_model, tiny_tokenizer):
    """The ids (and KV) of an answer cut at a stop string spell its message, not the stop string."""
    session = backend.session("t")
    session.extend(HISTORY)
    said = tiny_tokenizer.encode("the door code is 4417 Observation: the rest", add_special_tokens=False)
    text = session.generate(max_new_tokens=len(said), stop=["Observation:"], logits_processor=forcing(said))
    assert text and "Observation" not in text
    (answer,) = [s for s in session.spans if s.generated]
    assert tiny_tokenizer.decode(answer.token_ids) == answer.text  # no stop string among its ids
    assert "Observation" not in tiny_tokenizer.decode(session.token_ids())
    follow = [*HISTORY, {"role": "assistant", "content": text}, {"role": "user", "content": "And the gate?"}]
    assert session.extend(follow).cropped_tokens == 0  # the answer is reused as it is held
    assert_matches_full(session, tiny_model, said[:4])
    session.check()


def test_sampling_is_seeded(backend):
    outs = []
    for name in ("s1", "s2"):
        session = backend.session(name)
        session.extend(HISTORY)
        outs.append(session.generate(max_new_tokens=8, temperature=1.0, top_p=0.9, top_k=50, seed=7))
    assert outs[0] == outs[1]


def test_sessions_are_isolated(backend, tiny_model):
    a = backend.session("a")
    b = backend.session("b")
    a.extend(HISTORY)
    b.extend(HISTORY[:2])
    assert_matches_full(b, tiny_model, [1, 2])
    assert_matches_full(a, tiny_model, [1, 2])
    backend.close("a")
    assert "a" not in backend
    with pytest.raises(UnknownSessionError, match="unknown session 'a'"):
        backend.get("a")


def test_fork_shares_prefix_without_copy(backend, tiny_model):
    parent = backend.session("p")
    parent.extend(HISTORY)
    parent_bytes = parent.stats().device_bytes
    child = parent.fork("b1")
    child.extend([*HISTORY, {"role": "assistant", "content": "branch one thinks"}])
    stats = child.stats()
    assert stats.shared_device_bytes == parent_bytes
    own = stats.device_bytes - stats.shared_device_bytes
    assert own == (len(child.token_ids()) - len(parent.token_ids())) * backend.runner.bytes_per_token
    assert backend.device_bytes() == parent_bytes + own
    assert_matches_full(child, tiny_model, [4, 5])
    assert_matches_full(parent, tiny_model, [4, 5])


# -- bad input ------------------------------------------------------------------------------------


def test_unknown_session_is_a_clear_error(backend):
    with pytest.raises(UnknownSessionError, match="unknown session 'nope'"):
        backend.get("nope")
    with pytest.raises(UnknownSessionError):
        backend.close("nope")


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("hello", "expected a list"),
        ([42], r"messages\[0\]"),
        ([{"role": "wizard", "content": "x"}], "unknown role 'wizard'"),
        ([{"role": "user", "content": {"a": 1}}], r"messages\[0\]\.content"),
        ([{"content": "x"}], r"messages\[0\]\.role"),
    ],
)
def test_messages_in_a_wrong_shape(backend, messages, match):
    with pytest.raises((TypeError, ValueError), match=match):
        backend.session("t").extend(messages)


def test_max_new_tokens_must_be_positive(backend):
    session = backend.session("t")
    session.extend(HISTORY[:2])
    with pytest.raises(ValueError, match="max_new_tokens"):
        session.generate(max_new_tokens=0)


def test_sequence_longer_than_model_positions(backend):
    session = backend.session("t")
    too_long = [{"role": "user", "content": "lorem ipsum " * 3000}]
    with pytest.raises(ValueError, match="positions"):
        session.extend(too_long)
    assert session.stats().logical_tokens == 0


def test_generate_before_extend(backend):
    with pytest.raises(ValueError, match="extend"):
        backend.session("t").generate(max_new_tokens=4)


def test_model_without_chat_template_falls_back_with_warning(tiny_model, tiny_tokenizer, caplog):
    import copy

    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = None
    with caplog.at_level(logging.WARNING, logger="agentkv"):
        backend = TransformersBackend(tiny_model, tokenizer)
    assert "no chat template" in caplog.text
    session = backend.session("t")
    session.extend(HISTORY[:2])
    assert session.stats().prefill_tokens > 0


def test_a_fork_evicts_what_its_parent_archived(tiny_model, tiny_tokenizer):
    config = AgentKVConfig.from_dict({"policy": "full", "rules": {"custom:arch": {"owner": "archive"}}})
    parent = TransformersBackend(tiny_model, tiny_tokenizer, config).session("archiving")
    parent.extend(HISTORY)
    assert parent.apply(Custom(event="arch", owner="call_1")).transitions
    (span,) = parent.spans_owned_by("call_1")
    assert span.tier is Tier.HOST
    child = parent.fork("b2")
    clone = next(s for s in child.spans if s.span_id == span.span_id)
    # Archived blocks are not copied: the child's span is evicted (its tokens remain), the parent's is not.
    assert clone.state is SpanState.EVICTED and clone.tier is Tier.DROPPED and clone.kept is None
    assert span.state is SpanState.ARCHIVED and span.tier is Tier.HOST
    assert child.recallable == parent.recallable  # what recall may bring back is inherited
    child.check()
    parent.check()
