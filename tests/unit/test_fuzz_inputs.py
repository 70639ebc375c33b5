"""Fuzzing what users and frameworks hand agentkv: YAML configs, events and message lists.

Whatever comes in, agentkv either accepts it or answers with a clear error of its
own — a `ValueError` / `TypeError` with a message, raised from agentkv's code
(never an exception escaping from inside torch, transformers, tokenizers, jinja
or json) — and a rejected call leaves the session exactly as it was. Events for
unknown owners, duplicates and out-of-order events are logged no-ops.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import agentkv
from agentkv import (
    AgentKVConfig,
    BranchOpened,
    BranchPruned,
    BranchSelected,
    Custom,
    Event,
    SessionClosed,
    ToolCallCompleted,
    ToolCallFailed,
    TransformersBackend,
    TurnEnded,
    UserConfirmed,
    UserRejected,
)
from agentkv.lifecycle import ApplyResult

AGENTKV_DIR = str(Path(agentkv.__file__).parent)
EXAMPLES = int(os.environ.get("AGENTKV_FUZZ_EXAMPLES", "250"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=os.environ.get("AGENTKV_HYPOTHESIS_RANDOM") != "1",
    database=None,
    suppress_health_check=list(HealthCheck),
)
HISTORY = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_1", "name": "weather", "args": {"city": "Paris"}}],
    },
    {"role": "tool", "content": "search results: sunny skies", "tool_call_id": "call_1", "id": "r1"},
]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny-model forwards gain nothing from intra-op threads (and spin on busy machines)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def clear_error(call: Callable[[], Any]) -> BaseException | None:
    """Run `call`; None when it succeeds, else the error, which must be agentkv's own and clear."""
    try:
        call()
    except (ValueError, TypeError) as e:
        assert str(e).strip(), f"{type(e).__name__} without a message"
        last = traceback.extract_tb(e.__traceback__)[-1]
        assert last.filename.startswith(AGENTKV_DIR), (
            f"{type(e).__name__}({e}) escaped from {last.filename}:{last.lineno}, not from agentkv"
        )
        return e
    return None


# -- YAML ------------------------------------------------------------------------------------------

SECTION_KEYS = {
    "model": st.none() | st.text(max_size=8),
    "device": st.sampled_from([None, "cpu", "cuda:0", "CPU", "tpu:x", ""]),
    "dtype": st.sampled_from(["auto", "float32", "float16", "int8", None, 3]),
    "budget": st.dictionaries(
        st.sampled_from(
            [
                "device_tokens",
                "device_bytes",
                "host_tokens",
                "host_bytes",
                "global_device_bytes",
                "high_watermark",
                "low_watermark",
                "max_tokens",
            ]
        ),
        st.none()
        | st.integers(-5, 10**12)
        | st.floats(allow_nan=True)
        | st.sampled_from(["64MiB", "1.5 GB", "lots", "-1KiB"]),
        max_size=4,
    ),
    "policy": st.sampled_from(["lifecycle", "full", "window", "h2o", "nope", None, 5])
    | st.fixed_dictionaries(
        {"name": st.sampled_from(["window", "snapkv", "zzz"])},
        optional={
            "params": st.dictionaries(st.text(max_size=6), st.integers() | st.text(max_size=4), max_size=2)
        },
    ),
    "archive_tier": st.sampled_from(["host", "int8", "int4", "drop", "disk", None, 8]),
    "quantization": st.dictionaries(
        st.sampled_from(["group_size", "residual_tokens", "bits"]),
        st.integers(-3, 600) | st.text(max_size=3),
        max_size=2,
    ),
    "commit": st.dictionaries(
        st.sampled_from(["keep_ratio", "min_keep_tokens", "window"]),
        st.integers(-2, 50)
        | st.dictionaries(
            st.sampled_from(["tool_result", "user", "weird"]),
            st.floats(-1, 2) | st.text(max_size=3),
            max_size=2,
        ),
        max_size=2,
    ),
    "recall": st.dictionaries(
        st.sampled_from(["enabled", "max_spans", "min_score", "rehydrate_evicted"]),
        st.booleans() | st.integers(-2, 9) | st.floats(allow_nan=True) | st.none(),
        max_size=3,
    ),
    "rules": st.dictionaries(
        st.sampled_from(["tool_call_completed", "custom:x", "turn_ended", "bogus"]),
        st.dictionaries(
            st.sampled_from(["result", "call", "owner", "user", "zzz"]),
            st.sampled_from(["commit", "evict", "shred", "pin"]) | st.integers(),
            max_size=2,
        )
        | st.text(max_size=3),
        max_size=2,
    ),
    "callbacks": st.dictionaries(
        st.sampled_from(["raise_error", "other"]), st.booleans() | st.text(max_size=3), max_size=1
    ),
}
scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=12)
anything = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=12,
)


@st.composite
def yaml_documents(draw: Any) -> str:
    """Structured documents (near-valid `agentkv:` sections), mangled ones, and arbitrary text."""
    shape = draw(st.sampled_from(["section", "section", "mangled", "anything", "text"]))
    if shape == "text":
        return draw(st.text(max_size=200))
    if shape == "anything":
        return yaml.safe_dump(draw(anything), allow_unicode=True)
    keys = draw(st.lists(st.sampled_from(sorted(SECTION_KEYS)), unique=True, max_size=5))
    section = {key: draw(SECTION_KEYS[key]) for key in keys}
    if draw(st.booleans()):
        section[draw(st.text(min_size=1, max_size=8))] = draw(scalars)
    text = yaml.safe_dump({"graph": {"nodes": [1, 2]}, "agentkv": section}, allow_unicode=True)
    if shape == "mangled" and text:
        at = draw(st.integers(0, len(text) - 1))
        text = (
            text[:at]
            + draw(
                st.sampled_from(
                    ["", ":", "\t", "- ", "{", "]", "&a ", "*a", "!!python/object:os.system ", "\x00"]
                )
            )
            + text[at + 1 :]
        )
    return text


@FUZZ
@given(document=yaml_documents())
def test_yaml_configs_load_or_raise_a_clear_value_error(document):
    try:
        config = AgentKVConfig.from_yaml_text(document, source="graph.yaml")
    except ValueError as e:
        assert str(e).strip()
        assert type(e) is ValueError, f"{type(e).__name__} should be a plain ValueError"
        return
    assert isinstance(config, AgentKVConfig)
    assert AgentKVConfig.from_dict(config.to_dict()) == config


# -- events ----------------------------------------------------------------------------------------

names = st.text(max_size=12) | st.sampled_from(["call_1", "r1", "b1", "", "nobody"])
weird = (
    st.none()
    | st.integers()
    | st.floats(allow_nan=True)
    | st.lists(st.integers(), max_size=2)
    | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
)

events = st.one_of(
    st.builds(TurnEnded, turn=st.none() | st.integers(-3, 10**9)),
    st.builds(ToolCallCompleted, tool_call_id=names),
    st.builds(ToolCallFailed, tool_call_id=names, error=st.text(max_size=10)),
    st.builds(UserConfirmed, owner=st.none() | names),
    st.builds(UserRejected, owner=st.none() | names),
    st.builds(BranchOpened, branch=names, parent=st.none() | names),
    st.builds(BranchPruned, branch=names),
    st.builds(BranchSelected, branch=names),
    st.just(SessionClosed()),
    st.builds(
        Custom,
        event=names | st.sampled_from(["drop", "keep"]),
        owner=st.none() | names,
        payload=st.dictionaries(st.text(max_size=4), anything, max_size=2),
    ),
)
bad_events = st.one_of(
    st.builds(TurnEnded, turn=st.text(max_size=3) | st.lists(st.integers(), max_size=2) | st.booleans()),
    st.builds(ToolCallCompleted, tool_call_id=weird),
    st.builds(UserConfirmed, owner=st.integers() | st.lists(st.integers(), max_size=2)),
    st.builds(BranchPruned, branch=weird),
    st.builds(Custom, event=weird, owner=names),
    st.builds(Custom, event=names, owner=st.integers() | st.lists(st.text(max_size=2), max_size=2)),
    st.sampled_from(["turn_ended", None, 42, {"name": "turn_ended"}, TurnEnded]),
)


@pytest.fixture(scope="module")
def backend(tiny_model, tiny_tokenizer) -> TransformersBackend:
    config = AgentKVConfig.from_dict(
        {"rules": {"custom:drop": {"owner": "evict"}, "custom:keep": {"owner": "pin"}}}
    )
    return TransformersBackend(tiny_model, tiny_tokenizer, config)


@FUZZ
@given(sequence=st.lists(st.tuples(events | bad_events, st.integers(0, 2)), max_size=12))
def test_event_sequences_are_applied_noops_or_clear_errors(backend, sequence):
    """Random built-in/custom events, wrong field types, repeats (0-2 extra times) and any order."""
    session = backend.session("events")
    session.extend(HISTORY)
    try:
        for event, repeats in sequence:
            for attempt in range(1 + repeats):
                before = session.stats()
                outcome: list[Any] = []
                error = clear_error(lambda event=event, outcome=outcome: outcome.append(session.apply(event)))
                if error is not None:
                    assert not isinstance(event, Event) or not _well_typed(event), (
                        f"{event!r} was rejected: {error}"
                    )
                    after = session.stats()
                    assert (after.transitions, after.events_applied) == (
                        before.transitions,
                        before.events_applied,
                    )
                    break
                assert isinstance(event, Event) and _well_typed(event), f"{event!r} was accepted"
                (result,) = outcome
                assert isinstance(result, ApplyResult)
                if attempt:
                    assert not result.transitions, f"{event!r} changed spans again on a repeat"
                if not result.applied:
                    assert result.reason
            session.check()
            assert session.token_ids(), "events never drop tokens"
    finally:
        backend.close("events")


def _well_typed(event: Event) -> bool:
    text_fields = ("tool_call_id", "error", "branch", "event")
    optional = ("owner", "parent")
    for name in text_fields:
        if hasattr(event, name) and not isinstance(getattr(event, name), str):
            return False
    for name in optional:
        if (
            hasattr(event, name)
            and getattr(event, name) is not None
            and not isinstance(getattr(event, name), str)
        ):
            return False
    turn = getattr(event, "turn", None)
    return turn is None or (isinstance(turn, int) and not isinstance(turn, bool))


def test_backend_apply_rejects_a_non_event(backend):
    with pytest.raises(TypeError, match="expected an agentkv Event"):
        backend.apply("events-nowhere", "turn_ended")  # type: ignore[arg-type]


# -- messages --------------------------------------------------------------------------------------

unicode_text = st.text(
    st.characters(codec=None, categories=("L", "M", "N", "P", "S", "Z", "Cc", "Cf", "Co", "Cs")), max_size=60
) | st.sampled_from(
    [
        "emoji 🙂🧪👩‍👩‍👧 flags 🇫🇷",
        "RTL مرحبا بالعالم שלום",
        "NUL \x00 and BEL \x07 and ESC \x1b[31m",
        "zero\u200bwidth\u202eoverride",
        "lone surrogate \ud800 here",
        "{{ messages }} {% for x in y %}",
        "<|im_end|><|im_start|>system\n",
    ]
)
roles = st.sampled_from(
    ["system", "user", "assistant", "tool", "human", "ai", "developer", "function"]
) | st.sampled_from(["wizard", "", "USER", None, 3])
contents = (
    unicode_text
    | st.none()
    | st.integers()
    | st.lists(
        st.one_of(
            unicode_text,
            st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": unicode_text}),
            st.integers(),
        ),
        max_size=3,
    )
    | st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2)
    | st.binary(max_size=5)
)
tool_calls = (
    st.none()
    | st.lists(
        st.one_of(
            st.fixed_dictionaries({"id": names | weird, "name": names | weird}, optional={"args": anything}),
            st.fixed_dictionaries(
                {
                    "id": names,
                    "function": st.one_of(
                        st.fixed_dictionaries(
                            {"name": names}, optional={"arguments": st.text(max_size=10) | anything}
                        ),
                        anything,
                    ),
                }
            ),
            anything,
        ),
        max_size=2,
    )
    | st.text(max_size=4)
    | st.integers()
)
messages = st.one_of(
    st.fixed_dictionaries({"role": st.just("assistant"), "content": unicode_text, "tool_calls": tool_calls}),
    st.fixed_dictionaries({"role": roles, "content": unicode_text}),
    st.fixed_dictionaries(
        {"role": roles, "content": contents},
        optional={
            "tool_calls": tool_calls,
            "tool_call_id": names | weird,
            "id": names | weird,
            "name": weird | names,
        },
    ),
    st.tuples(roles, contents),
    st.tuples(roles),
    anything,
)
message_lists = st.lists(messages, max_size=6) | st.sampled_from(
    ["hello", None, 5, {"role": "user"}, b"bytes"]
)


@FUZZ
@given(incoming=message_lists)
def test_message_lists_are_encoded_or_rejected_clearly(backend, incoming):
    """Wrong roles, types and shapes, unicode of every kind: encoded, or a clear error and no change."""
    session = backend.session("messages")
    try:
        session.extend(HISTORY[:2])
        before = (
            session.token_ids(),
            [m.fingerprint() for m in session.messages],
            session.stats().attended_tokens,
        )
        error = clear_error(lambda: session.extend(incoming))
        if error is not None:
            after = (
                session.token_ids(),
                [m.fingerprint() for m in session.messages],
                session.stats().attended_tokens,
            )
            assert after == before, "a rejected extend changed the session"
        else:
            assert len(session.messages) == len(incoming)
        session.check()
        # Whatever happened, the session still works.
        session.extend([*HISTORY, {"role": "user", "content": "still there?"}])
        session.generate(max_new_tokens=1)
        session.check()
    finally:
        backend.close("messages")


@FUZZ
@given(
    words=st.integers(0, 1200),
    alphabet=st.sampled_from(["lorem ipsum ", "🙂", "مرحبا ", "a\x00", "0123456789 "]),
    split=st.integers(1, 4),
)
def test_long_messages_fit_or_raise_naming_positions(backend, words, alphabet, split):
    """Long content up to well past the tiny model's 2048 positions, in one or several messages."""
    session = backend.session("long")
    try:
        content = alphabet * words
        chunk = -(-len(content) // split) if content else 1
        incoming = [{"role": "system", "content": "You are a helpful assistant."}]
        incoming += [
            {"role": "user", "content": content[i : i + chunk]} for i in range(0, len(content), chunk)
        ]
        need = sum(
            len(ids) for ids in backend.chat_format.message_ids(agentkv.chat.normalize_messages(incoming))
        )
        error = clear_error(lambda: session.extend(incoming))
        if need > backend.runner.max_positions:
            assert isinstance(error, ValueError) and "positions" in str(error) and str(need) in str(error)
            assert session.stats().logical_tokens == 0
        else:
            assert error is None
            assert session.stats().logical_tokens == need
            session.check()
            prompt = len(session.format.generation_prompt_ids(session.messages))
            room = backend.runner.max_positions - need - prompt - len(session.format.assistant_suffix_ids())
            # One token more than fits is refused up front, naming positions.
            error = clear_error(lambda: session.generate(max_new_tokens=max(1, room + 1)))
            assert isinstance(error, ValueError) and "positions" in str(error)
            if room >= 1:
                session.generate(max_new_tokens=1)
            session.check()
    finally:
        backend.close("long")


def test_generate_arguments_are_checked(backend):
    session = backend.session("gen")
    session.extend(HISTORY)
    for kwargs in (
        {"max_new_tokens": 0},
        {"max_new_tokens": "3"},
        {"temperature": -1.0},
        {"top_p": 0.0},
        {"top_k": -2},
        {"stop": 5},
        {"prefix": 5},
        {"message_id": 7},
        {"stop": [""]},
    ):
        error = clear_error(lambda kwargs=kwargs: session.generate(**kwargs))
        assert error is not None, kwargs
    session.check()
    backend.close("gen")


@pytest.mark.parametrize(
    ("message", "match"),
    [
        ({"role": "user", "content": "half an emoji \ud83d"}, r"messages\[0\]\.content: not valid Unicode"),
        (
            {"role": "user", "content": [{"type": "text", "text": "x\udc80"}]},
            r"messages\[0\]\.content: not valid",
        ),
        ({"role": "user", "content": b"bytes"}, r"messages\[0\]\.content: expected a string"),
        ({"role": "assistant", "content": "", "tool_calls": 5}, r"tool_calls: expected a list"),
        ({"role": "assistant", "content": "", "tool_calls": "call"}, r"tool_calls: expected a list"),
        (
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "function": "f"}]},
            r"function: expected",
        ),
        (
            {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "args": "x=1"}]},
            r"arguments: expected",
        ),
        ({"role": "assistant", "content": "", "tool_calls": [{"name": "f", "args": {1: 2}}]}, r"string keys"),
        (
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "f", "arguments": "[1, 2]"}}],
            },
            r"arguments: expected a mapping",
        ),
    ],
)
def test_malformed_messages_name_the_field(backend, message, match):
    session = backend.session("bad")
    try:
        error = clear_error(lambda: session.extend([message]))
        assert error is not None and __import__("re").search(match, str(error)), error
        assert session.stats().logical_tokens == 0
    finally:
        backend.close("bad")


def test_unencodable_prefix_is_a_clear_error(backend):
    session = backend.session("prefix")
    session.extend(HISTORY)
    error = clear_error(lambda: session.generate(max_new_tokens=2, prefix="\ud800"))
    assert isinstance(error, ValueError) and "not valid Unicode" in str(error)
    session.check()
    assert session.generate(max_new_tokens=2, prefix="ok") is not None
    backend.close("prefix")
