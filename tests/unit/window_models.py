"""The window tests' models: the family matrix (`tests/families.py`) plus its windowed variants.

The matrix's windowed families (Mistral, Gemma 2/3, Starcoder2, Cohere2, OLMo3) slide
by `WINDOW` tokens; the variants here give a window to families whose configs allow
one and the matrix builds without: Phi-3 with `sliding_window` on every layer, Qwen2
and Qwen3 with windowed `layer_types` (three windowed layers, one full).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from tests.families import FAMILIES, WINDOW, build, family_by_name, unavailable

_HYBRID = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "phi3-window": ("phi3", {"sliding_window": WINDOW}),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "layer_types": _HYBRID}),
    "qwen3-window": ("qwen3", {"use_sliding_window": True, "sliding_window": WINDOW, "layer_types": _HYBRID}),
}
"""Windowed variants: name -> (matrix family, config overrides)."""

WINDOWED_CASES = [f.name for f in FAMILIES if f.windowed] + list(VARIANTS)
"""Every case with sliding-window layers."""
FULL_CASES = [f.name for f in FAMILIES if not f.windowed]
"""Full-attention families: nothing windowed may change them."""

__all__ = ["FULL_CASES", "VARIANTS", "WINDOW", "WINDOWED_CASES", "build_case", "case_params"]


@functools.cache
def build_case(name: str) -> torch.nn.Module:
    """The tiny fp32 model of case `name` with its family's default kernel (cached: do not mutate it)."""
    family_name, overrides = VARIANTS.get(name, (name, {}))
    return build(family_by_name(family_name), **overrides)


def case_params(names: list[str]) -> list[Any]:
    """`pytest.param`s for cases, a family transformers cannot build skipped with its reason."""
    out = []
    for name in names:
        reason = unavailable(family_by_name(VARIANTS.get(name, (name, {}))[0]))
        out.append(pytest.param(name, id=name, marks=[pytest.mark.skip(reason=reason)] if reason else []))
    return out
