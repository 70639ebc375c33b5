"""Every family in the matrix: exact reuse, the default policy under a budget, the probe against eager.

The families come from `tests/families.py` (tiny random models built in-process); a
family this transformers cannot build is skipped with its reason.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from agentkv import AgentKVConfig, TransformersBackend
from agentkv.backend.masks import FULL, AttentionLayout
from agentkv.policies import AttentionProbe
from agentkv.spans import SpanState, Tier
from tests.families import FAMILIES, Family, build, family_params
from tests.unit.session_history import HISTORY

EXACT = 1e-5
"""fp32 tolerance of a forward over agentkv's cache against a plain forward (max abs logit)."""
PROBE_TOL = 1e-5
"""Tolerance of the probe's per-layer attention against eager attention weights."""
ROWS = 6
"""Probed query rows."""


@functools.cache
def _model(name: str, kernel: str | None = None) -> Any:
    family = next(p.values[0] for p in family_params() if p.values[0].name == name)
    return build(family, kernel)


def _kernel_params() -> list[Any]:
    return [
        pytest.param(p.values[0], kernel, id=f"{p.id}-{kernel}", marks=p.marks)
        for p in family_params()
        for kernel in p.values[0].kernels
    ]


def _full_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float()  # [n, V]


# -- the probe reads what the kernel computes ------------------------------------------------------


@pytest.mark.parametrize("prefix", [0, 24], ids=["prefill", "over-cache"])
@pytest.mark.parametrize(("family", "kernel"), _kernel_params())
def test_probe_equals_eager_attention_weights(family: Family, kernel: str, prefix: int) -> None:
    """Per layer, the probed rows' attention equals `output_attentions` of an eager copy."""
    model, eager = _model(family.name, kernel), _model(family.name, "eager")
    ids = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(7))
    ours, theirs = DynamicCache(config=model.config), DynamicCache(config=eager.config)
    with torch.no_grad():
        if prefix:
            model(input_ids=ids[:, :prefix], cache=ours, use_cache=True)
            eager(input_ids=ids[:, :prefix], cache=theirs, use_cache=True)
        with AttentionProbe(model, ROWS) as probe:
            model(input_ids=ids[:, prefix:], cache=ours, use_cache=True)
        out = eager(input_ids=ids[:, prefix:], cache=theirs, use_cache=True, output_attentions=True)
    assert probe.hook_count == 0
    assert model.config._attn_implementation == kernel
    got = probe.layer_attention
    assert sorted(got) == list(range(len(out.attentions)))
    for layer, weights in enumerate(out.attentions):  # each [B, H, q, S]
        expected = weights[..., -ROWS:, :].float().mean(dim=(0, 1, 2))  # [S]
        torch.testing.assert_close(got[layer], expected, atol=PROBE_TOL, rtol=0, msg=f"layer {layer}")


# -- the backend on every family -------------------------------------------------------------------


@pytest.mark.parametrize("family", family_params())
def test_first_prefill_and_decode_equal_a_plain_forward(family: Family, tiny_tokenizer: Any) -> None:
    """With the default config and nothing evicted, every forward equals a plain forward of all tokens."""
    model = _model(family.name)
    backend = TransformersBackend(model, tiny_tokenizer, AgentKVConfig())
    session = backend.session("t")
    session.extend(HISTORY)
    ids = session.token_ids()
    assert (session.last_logits - _full_logits(model, ids)[-1]).abs().max().item() <= EXACT
    prompt = ids + backend.chat_format.generation_prompt_ids(session.messages)
    session.generate(max_new_tokens=6)
    with torch.inference_mode():
        reference = model.generate(
            torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
    produced = session.token_ids()[len(prompt) :]
    stops = set(backend.chat_format.stop_token_ids())
    expected = reference[: next((i for i, t in enumerate(reference) if t in stops), len(reference))]
    assert produced[: len(expected)] == expected
    probe = [5, 6, 7]
    managed = session.continuation_logits(probe)
    full = _full_logits(model, session.token_ids() + probe)[-len(probe) :]
    assert (managed - full).abs().max().item() <= EXACT
    session.check()


TURNS = [
    {"role": "user", "content": "The secret code is 4417. Remember the package tracking number ZX-99."},
    {"role": "user", "content": "search results: lorem ipsum dolor sit amet, consectetur adipiscing elit"},
    {
        "role": "user",
        "content": "the user asked about the weather in Paris and the tool returned sunny skies",
    },
    {"role": "user", "content": "And the code?"},
]


@pytest.mark.parametrize("family", family_params())
def test_default_policy_meets_a_budget_over_turns(family: Family, tiny_tokenizer: Any) -> None:
    """The default policy (attention-scored) runs every family under budget pressure, turn after turn.

    Sliding layers are charged only for the slots they can still attend, so a hybrid
    family's budget is scaled to its full layers' share to press as hard; a family whose
    every layer slides holds a window's worth at most and a budget never presses it.
    """
    model = _model(family.name)
    layout = AttentionLayout.of(model.config)
    full = len(layout.layers_of(FULL))
    config = AgentKVConfig.from_dict(
        {"budget": {"device_tokens": max(8, 64 * full // len(layout.layer_types))}}
    )
    session = TransformersBackend(model, tiny_tokenizer, config).session("t")
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant."}]
    for turn in TURNS:
        messages.append(turn)
        session.extend(messages)
        answer = session.generate(max_new_tokens=4)
        messages.append({"role": "assistant", "content": answer})
        session.check()
        stats = session.stats()
        assert stats.budget_satisfied, stats
    demoted = [s for s in session.spans if s.state is SpanState.ARCHIVED or s.tier is Tier.ATTENDED_QUANTIZED]
    assert demoted or not full, "the budget never pressed: the test would not exercise the probe"


def test_docs_list_every_family_with_its_kernels() -> None:
    """docs/models.md has one row per family of the matrix, as the matrix defines it."""
    text = (Path(__file__).parents[2] / "docs" / "models.md").read_text(encoding="utf-8")
    for family in FAMILIES:
        windowed = "yes" if family.windowed else ""
        kernels = ", ".join(family.kernels)
        row = f"| {family.name} | `{family.model_class}` | {family.traits} | {kernels} | {windowed} |"
        assert row in text, f"docs/models.md lacks or misstates: {row}"
