"""The family matrix: tiny random causal LMs of many transformers families, built in-process.

Each `Family` names a transformers config/model class and the few config fields that
make it tiny (4 layers, hidden 64, 4 query heads over 2 KV heads, vocab 512 to match
the `tiny_tokenizer` fixture) while keeping what makes the family itself: fused qkv
(Phi-3, GPT-NeoX), partial rotary (Phi-2, StableLM, GLM, GPT-NeoX), whole-projection
q/k norms (OLMo2), interleaved RoPE (Cohere, GLM), layers without RoPE (SmolLM3),
softcapping (Gemma 2), sliding-window and hybrid layers (Mistral, Gemma 2/3, Cohere2,
OLMo3, Starcoder2), mixture-of-experts MLPs (Mixtral, Qwen3-MoE).

`build(family)` returns an fp32 eval model with no gradients and a fixed seed, so two
builds are identical. A family that this transformers cannot build is skipped with the
reason (`family_params()` marks it). Windowed families use `WINDOW` slots so a prompt
of a few dozen tokens is already several windows long.

Usage in a test::

    @pytest.mark.parametrize("family", family_params())
    def test_x(family: Family) -> None:
        model = build(family)  # or build(family, kernel="eager")
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

__all__ = ["FAMILIES", "WINDOW", "Family", "build", "family_params", "unavailable"]

WINDOW = 8
"""Sliding window (tokens) of every windowed family's windowed layers."""

LAYERS = 4
"""Decoder layers of every family."""

_BASE: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
"""Fields every family's config gets (a family's own `overrides` win)."""

_HYBRID = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
"""Layer types of the hybrid families: three windowed layers, then one full layer."""


@dataclass(frozen=True)
class Family:
    """One transformers model family as a tiny random model.

    `kernels` lists the attention implementations transformers runs this family with
    (the first is the one `load_model` picks); `traits` says what makes the family
    differ from Llama, for test ids and docs.
    """

    name: str
    config_class: str
    model_class: str
    module: str
    overrides: dict[str, Any] = field(default_factory=dict)
    kernels: tuple[str, ...] = ("sdpa", "eager")
    traits: str = ""
    windowed: bool = False

    def __str__(self) -> str:
        return self.name


FAMILIES: tuple[Family, ...] = (
    Family("llama", "LlamaConfig", "LlamaForCausalLM", "llama", traits="reference"),
    Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM", "qwen2", traits="qkv bias"),
    Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM", "qwen3", {"head_dim": 16}, traits="per-head q/k norm"),
    Family(
        "qwen3_moe",
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
        traits="per-head q/k norm, mixture of experts",
    ),
    Family(
        "mixtral",
        "MixtralConfig",
        "MixtralForCausalLM",
        "mixtral",
        {"num_local_experts": 4, "num_experts_per_tok": 2},
        traits="mixture of experts",
    ),
    Family(
        "mistral",
        "MistralConfig",
        "MistralForCausalLM",
        "mistral",
        {"sliding_window": WINDOW},
        traits="sliding window on every layer",
        windowed=True,
    ),
    Family("gemma", "GemmaConfig", "GemmaForCausalLM", "gemma", {"head_dim": 16}, traits="scaled embeddings"),
    Family(
        "gemma2",
        "Gemma2Config",
        "Gemma2ForCausalLM",
        "gemma2",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 16,
            "attn_logit_softcapping": 1.0,
        },
        kernels=("eager",),
        traits="attention softcap (eager), alternating sliding/full layers",
        windowed=True,
    ),
    Family(
        "gemma3",
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        "gemma3",
        {"head_dim": 16, "sliding_window": WINDOW, "layer_types": _HYBRID, "query_pre_attn_scalar": 16},
        traits="per-head q/k norm, hybrid sliding/full layers, two RoPE bases",
        windowed=True,
    ),
    Family("phi3", "Phi3Config", "Phi3ForCausalLM", "phi3", traits="fused qkv_proj"),
    Family(
        "phi",
        "PhiConfig",
        "PhiForCausalLM",
        "phi",
        {"partial_rotary_factor": 0.5},
        traits="partial rotary (Phi-2), parallel block",
    ),
    Family(
        "gpt_neox",
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        "gpt_neox",
        {"num_key_value_heads": 4, "partial_rotary_factor": 0.25, "tie_word_embeddings": False},
        traits="fused query_key_value, partial rotary",
    ),
    Family(
        "stablelm",
        "StableLmConfig",
        "StableLmForCausalLM",
        "stablelm",
        {"partial_rotary_factor": 0.25, "qk_layernorm": True},
        traits="partial rotary, per-head q/k layer norm",
    ),
    Family("olmo", "OlmoConfig", "OlmoForCausalLM", "olmo", {"clip_qkv": 2.0}, traits="clipped qkv"),
    Family("olmo2", "Olmo2Config", "Olmo2ForCausalLM", "olmo2", traits="q/k norm over the whole projection"),
    Family(
        "cohere",
        "CohereConfig",
        "CohereForCausalLM",
        "cohere",
        {"use_qk_norm": True, "logit_scale": 0.5},
        traits="interleaved RoPE, q/k layer norm, parallel block",
    ),
    Family(
        "granite",
        "GraniteConfig",
        "GraniteForCausalLM",
        "granite",
        {
            "attention_multiplier": 0.2,
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5,
            "logits_scaling": 4.0,
        },
        traits="custom attention scaling and multipliers",
    ),
    Family(
        "glm",
        "GlmConfig",
        "GlmForCausalLM",
        "glm",
        {"head_dim": 16, "partial_rotary_factor": 0.5},
        traits="partial interleaved rotary",
    ),
    Family(
        "smollm3",
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        "smollm3",
        {"no_rope_layer_interval": 2},
        traits="layers without RoPE",
    ),
    Family(
        "starcoder2",
        "Starcoder2Config",
        "Starcoder2ForCausalLM",
        "starcoder2",
        {"sliding_window": WINDOW},
        traits="biases, layer norm, sliding window on every layer",
        windowed=True,
    ),
    Family(
        "cohere2",
        "Cohere2Config",
        "Cohere2ForCausalLM",
        "cohere2",
        {"sliding_window": WINDOW, "layer_types": _HYBRID},
        traits="interleaved RoPE, hybrid sliding/full layers (no RoPE on full layers)",
        windowed=True,
    ),
    Family(
        "olmo3",
        "Olmo3Config",
        "Olmo3ForCausalLM",
        "olmo3",
        {"sliding_window": WINDOW, "layer_types": _HYBRID},
        traits="whole-projection q/k norm, hybrid sliding/full layers",
        windowed=True,
    ),
    Family(
        "gpt_oss",
        "GptOssConfig",
        "GptOssForCausalLM",
        "gpt_oss",
        {
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": WINDOW,
            "max_position_embeddings": 131072,  # its YaRN factor (32) over a 4k original context
        },
        kernels=("eager",),
        traits="attention sinks (eager), mixture of experts, alternating sliding/full layers",
        windowed=True,
    ),
)
"""Every family in the matrix, Llama first."""


def family_by_name(name: str) -> Family:
    """The family called `name` (ValueError listing the names otherwise)."""
    for family in FAMILIES:
        if family.name == name:
            return family
    msg = f"unknown family {name!r}; expected one of {', '.join(f.name for f in FAMILIES)}"
    raise ValueError(msg)


def config(family: Family, **overrides: Any) -> Any:
    """The family's tiny config (a transformers `PretrainedConfig`)."""
    module = importlib.import_module(f"transformers.models.{family.module}")
    values = {**_BASE, **family.overrides, **overrides}
    return getattr(module, family.config_class)(**values)


def build(family: Family, kernel: str | None = None, *, seed: int = 0, **overrides: Any) -> Any:
    """A tiny random fp32 eval model of `family` with attention `kernel` (default: its first).

    Raises:
        pytest.skip.Exception: transformers cannot build this family (`unavailable`).
    """
    reason = unavailable(family)
    if reason is not None:
        pytest.skip(reason)
    kernel = kernel or family.kernels[0]
    module = importlib.import_module(f"transformers.models.{family.module}")
    cfg = config(family, **overrides)
    cfg._attn_implementation = kernel
    torch.manual_seed(seed)
    model = getattr(module, family.model_class)(cfg).eval().to(torch.float32)
    _perturb_norms(model)
    model.requires_grad_(False)
    return model


def _perturb_norms(model: torch.nn.Module) -> None:
    """Give every norm weight a non-trivial value, so a probe that skips a norm cannot pass."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            owner = name.rsplit(".", 2)[-2] if "." in name else ""
            if "norm" in owner and parameter.dim() >= 1:
                noise = torch.rand(parameter.shape, generator=generator) * 0.5 - 0.25
                parameter.add_(noise.to(parameter.dtype))


def unavailable(family: Family) -> str | None:
    """Why transformers cannot build `family` here, or None when it can."""
    return _unavailable(family.name)


@functools.cache
def _unavailable(name: str) -> str | None:
    family = family_by_name(name)
    try:
        module = importlib.import_module(f"transformers.models.{family.module}")
        getattr(module, family.config_class)
        getattr(module, family.model_class)
        config(family)
    except (ImportError, AttributeError, TypeError, ValueError) as e:
        return f"{family.name}: transformers cannot build {family.model_class} here ({type(e).__name__}: {e})"
    return None


def family_params(*, windowed: bool | None = None) -> list[Any]:
    """`pytest.param`s for every family (only the windowed or only the full ones when asked)."""
    chosen = [f for f in FAMILIES if windowed is None or f.windowed == windowed]
    return [
        pytest.param(f, id=f.name, marks=[pytest.mark.skip(reason=r)] if (r := unavailable(f)) else [])
        for f in chosen
    ]
