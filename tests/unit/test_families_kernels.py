"""Any attention kernel: `load_model` picks the family's or the named one, and reuse stays exact on each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from agentkv import AgentKVConfig, TransformersBackend
from agentkv.models import KERNELS, ModelLoadError, load_model
from agentkv.spans import Tier
from tests.families import Family, build, family_by_name, family_params
from tests.unit.session_history import HISTORY
from tests.unit.store_moves import archive, restore

EXACT = 1e-5


def _saved(tmp_path: Path, family: Family, tokenizer: Any) -> Path:
    """A tiny random model of `family` saved as a Transformers directory, with the test tokenizer."""
    model = build(family)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize(("name", "expected"), [("llama", "sdpa"), ("gemma2", "eager")])
def test_the_family_s_kernel_by_default(
    tmp_path: Path, tiny_tokenizer: Any, name: str, expected: str
) -> None:
    """SDPA where the family runs it; eager for Gemma 2, which has no SDPA path (attention softcap)."""
    model, _ = load_model(_saved(tmp_path, family_by_name(name), tiny_tokenizer), device="cpu")
    assert model.config._attn_implementation == expected


def test_the_named_kernel(tmp_path: Path, tiny_tokenizer: Any) -> None:
    path = _saved(tmp_path, family_by_name("llama"), tiny_tokenizer)
    for kernel in KERNELS:
        model, _ = load_model(path, device="cpu", attn_implementation=kernel)
        assert model.config._attn_implementation == kernel


def test_a_kernel_without_logical_masks_is_refused(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"attn_implementation: expected one of sdpa, eager .*'flash_attention_2'"
    ):
        load_model(tmp_path, device="cpu", attn_implementation="flash_attention_2")


def test_a_kernel_the_family_lacks_is_a_load_error(tmp_path: Path, tiny_tokenizer: Any) -> None:
    path = _saved(tmp_path, family_by_name("gemma2"), tiny_tokenizer)
    with pytest.raises(ModelLoadError, match="scaled_dot_product_attention"):
        load_model(path, device="cpu", attn_implementation="sdpa")


def test_the_config_names_the_kernel() -> None:
    assert AgentKVConfig().attn_implementation is None
    assert AgentKVConfig.from_dict({"attn_implementation": "eager"}).attn_implementation == "eager"
    with pytest.raises(ValueError, match="attn_implementation"):
        AgentKVConfig.from_dict({"attn_implementation": "flash_attention_2"})


def _kernel_params() -> list[Any]:
    return [
        pytest.param(p.values[0], kernel, id=f"{p.id}-{kernel}", marks=p.marks)
        for p in family_params(windowed=False)
        for kernel in p.values[0].kernels
    ]


@pytest.mark.parametrize(("family", "kernel"), _kernel_params())
def test_restore_is_exact_on_each_kernel(family: Family, kernel: str, tiny_tokenizer: Any) -> None:
    """A span archived and restored sits at the physical end: the logical mask, in the kernel's
    form (bool for SDPA, additive for eager), keeps the logits those of a plain forward."""
    model = build(family, kernel)
    session = TransformersBackend(model, tiny_tokenizer, AgentKVConfig.from_dict({"policy": "full"})).session(
        "t"
    )
    session.extend(HISTORY)
    span = session.spans[2]
    archive(session.store, span, "host")
    restore(session.store, [span])
    assert span.tier is Tier.DEVICE
    probe = [21, 22]
    managed = session.continuation_logits(probe)
    with torch.inference_mode():
        full = model(input_ids=torch.tensor([session.token_ids() + probe])).logits[0, -len(probe) :].float()
    assert (managed - full).abs().max().item() <= EXACT
    session.check()
