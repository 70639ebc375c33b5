"""A session on the attended quantized tier, small groups and window, for the key-plane and cost tests."""

from __future__ import annotations

from typing import Any

from agentkv import AgentKVConfig, TransformersBackend

GROUP = 16
"""Key group size of these sessions (small, so a short history fills whole groups)."""


def attended_session(
    tiny_model: Any, tiny_tokenizer: Any, key_bits: int, device_tokens: int | None = None
) -> Any:
    """A `lifecycle` session dropping what it archives, values at 4 bits, keys at `key_bits`.

    With `device_tokens`, a device budget planned on the priors' rung costs (8-bit keys lose a fifth
    of 4-bit keys): the tiny random model's calibration measures both alike, and then the plan holds
    no key at 8 bits at all.
    """
    data: dict[str, Any] = {
        "policy": "lifecycle",
        "archive_tier": "drop",
        "quantization": {
            "attended_bits": 4,
            "attended_key_bits": key_bits,
            "group_size": GROUP,
            "attended_residual_tokens": 16,
        },
    }
    if device_tokens is not None:
        data["budget"] = {"device_tokens": device_tokens, "rung_costs": "fixed"}
    return TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig.from_dict(data)).session("s")
