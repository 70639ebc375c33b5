"""Tiny random windowed models (and full-attention controls) for the window tests.

Each case names a transformers family and the config that makes it tiny (4 layers,
hidden 64, vocab 512 for the `tiny_tokenizer`), with a `WINDOW`-token sliding window
on its windowed layers: all layers (Mistral, Phi-3, Starcoder2), alternating
(Gemma 2, Cohere2), or a hybrid of three windowed layers and one full layer (Gemma 3,
Qwen2 / Qwen3 with `layer_types`, OLMo3).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import pytest
import torch

WINDOW = 8
"""Sliding window (tokens) of every windowed layer."""

_HYBRID = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
_ALTERNATING = ["sliding_attention", "full_attention"] * 2

_BASE: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

_CASES: dict[str, tuple[str, str, str, str, dict[str, Any]]] = {
    # name: (module, config class, model class, kernel, overrides)
    "mistral": ("mistral", "MistralConfig", "MistralForCausalLM", "sdpa", {"sliding_window": WINDOW}),
    "phi3": ("phi3", "Phi3Config", "Phi3ForCausalLM", "sdpa", {"sliding_window": WINDOW}),
    "starcoder2": (
        "starcoder2",
        "Starcoder2Config",
        "Starcoder2ForCausalLM",
        "sdpa",
        {"sliding_window": WINDOW},
    ),
    "gemma2": (
        "gemma2",
        "Gemma2Config",
        "Gemma2ForCausalLM",
        "eager",
        {"head_dim": 16, "sliding_window": WINDOW, "query_pre_attn_scalar": 16, "layer_types": _ALTERNATING},
    ),
    "gemma3": (
        "gemma3",
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        "sdpa",
        {"head_dim": 16, "sliding_window": WINDOW, "query_pre_attn_scalar": 16, "layer_types": _HYBRID},
    ),
    "qwen2": (
        "qwen2",
        "Qwen2Config",
        "Qwen2ForCausalLM",
        "sdpa",
        {"use_sliding_window": True, "sliding_window": WINDOW, "layer_types": _HYBRID},
    ),
    "qwen3": (
        "qwen3",
        "Qwen3Config",
        "Qwen3ForCausalLM",
        "sdpa",
        {"head_dim": 16, "use_sliding_window": True, "sliding_window": WINDOW, "layer_types": _HYBRID},
    ),
    "cohere2": (
        "cohere2",
        "Cohere2Config",
        "Cohere2ForCausalLM",
        "sdpa",
        {"sliding_window": WINDOW, "layer_types": _ALTERNATING},
    ),
    "llama": ("llama", "LlamaConfig", "LlamaForCausalLM", "sdpa", {}),
    "qwen2-full": ("qwen2", "Qwen2Config", "Qwen2ForCausalLM", "sdpa", {}),
}

WINDOWED_CASES = ["mistral", "phi3", "starcoder2", "gemma2", "gemma3", "qwen2", "qwen3", "cohere2"]
"""Cases with sliding-window layers."""
FULL_CASES = ["llama", "qwen2-full"]
"""Full-attention controls: nothing windowed may change them."""


@functools.cache
def build_case(name: str, kernel: str | None = None) -> torch.nn.Module:
    """A tiny random fp32 eval model for case `name` (cached; do not mutate it)."""
    module_name, config_class, model_class, default_kernel, overrides = _CASES[name]
    try:
        module = importlib.import_module(f"transformers.models.{module_name}")
        config = getattr(module, config_class)(**{**_BASE, **overrides})
    except (ImportError, AttributeError, TypeError, ValueError) as e:
        pytest.skip(f"{name}: transformers cannot build {model_class} here ({type(e).__name__}: {e})")
    config._attn_implementation = kernel or default_kernel
    torch.manual_seed(0)
    model = getattr(module, model_class)(config).eval().to(torch.float32)
    model.requires_grad_(False)
    return model
