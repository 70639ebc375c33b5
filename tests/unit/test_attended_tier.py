"""The attended quantized tier (KIVI int4/int2, full-precision residual window, dequantized on read).

Tolerances, and why: int4 round-to-nearest puts every key/value within half a step
of its group's range (range / 15 / 2 per group; for the tiny random model's KV that
is a few hundredths), and a softmax over perturbed keys moves the logits by about
that much times the value norm. The session test bounds the logit error relative to
the logits' own spread (max |Δ| <= 5% of max |logit| at int4, 20% at int2) and
requires the same greedy token; the measured errors are far below (see the asserts'
messages). With the residual window covering every token nothing is quantized and
the logits are those of the full-precision cache exactly (same tensors, same ops).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from agentkv import AgentKVConfig, TransformersBackend
from agentkv.store.attended import QuantizedAttendedLayer, check_attended_spec
from agentkv.store.block import tensor_bytes

MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "The secret code is 4417. Remember the package tracking number ZX-99. " * 6},
    {"role": "assistant", "content": "the tool returned sunny skies in Paris " * 4},
    {"role": "user", "content": "What is the secret code?"},
]


def _layer(bits: int, group: int = 16, residual: int = 8) -> QuantizedAttendedLayer:
    return QuantizedAttendedLayer(bits, group, residual)


@pytest.mark.parametrize("bits", [4, 2])
def test_layer_round_trip_within_half_a_step_and_window_exact(bits: int) -> None:
    torch.manual_seed(0)
    k, v = torch.randn(1, 2, 100, 16), torch.randn(1, 2, 100, 16)
    layer = _layer(bits)
    layer.set_all(k, v)
    assert layer.quantized_length == 80 and layer.residual_length == 20  # (100 - 8) // 16 * 16 = 80
    full = layer.full()
    assert full is not None
    got_k, got_v = full
    # The window is exact; quantized keys stay within half a step of their (token group, channel) range.
    assert torch.equal(got_k[:, :, 80:], k[:, :, 80:]) and torch.equal(got_v[:, :, 80:], v[:, :, 80:])
    qmax = (1 << bits) - 1
    groups = k[:, :, :80].reshape(1, 2, 5, 16, 16)
    step = (groups.amax(dim=3) - groups.amin(dim=3)) / qmax  # [1, 2, 5, 16]
    err = (got_k[:, :, :80] - k[:, :, :80]).abs().reshape(1, 2, 5, 16, 16).amax(dim=3)
    assert bool((err <= step / 2 * 1.01 + 1e-3).all())
    v_step = (v[:, :, :80].amax(dim=-1) - v[:, :, :80].amin(dim=-1)) / qmax  # one channel group of 16
    v_err = (got_v[:, :, :80] - v[:, :, :80]).abs().amax(dim=-1)
    assert bool((v_err <= v_step / 2 * 1.01 + 1e-3).all())


@pytest.mark.parametrize("bits", [4, 2])
def test_streaming_updates_quantize_like_one_set_all(bits: int) -> None:
    torch.manual_seed(1)
    k, v = torch.randn(1, 2, 70, 16), torch.randn(1, 2, 70, 16)
    whole, streamed = _layer(bits), _layer(bits)
    whole.set_all(k, v)
    streamed.update(k[:, :, :30], v[:, :, :30])
    for t in range(30, 70):
        out_k, _ = streamed.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
        assert out_k.shape[-2] == t + 1
    a, b = whole.full(), streamed.full()
    assert a is not None and b is not None
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert streamed.residual_length < 8 + 16


def test_bytes_are_what_is_held_and_far_below_full_precision() -> None:
    k, v = torch.randn(1, 2, 512, 16), torch.randn(1, 2, 512, 16)
    for bits, most in ((4, 0.30), (2, 0.22)):
        layer = _layer(bits, group=32, residual=32)
        layer.set_all(k, v)
        held = sum(tensor_bytes(t) for t in layer.own_tensors())
        assert held < most * (tensor_bytes(k) + tensor_bytes(v)), (bits, held)
        codes = layer.key_codes
        assert codes is not None and codes.dtype == torch.uint8 and codes.shape[-1] == 16 * bits // 8


def _last_logits(tiny_model: Any, tiny_tokenizer: Any, quantization: dict[str, Any] | None) -> torch.Tensor:
    data: dict[str, Any] = {"policy": "full"}
    if quantization is not None:
        data["quantization"] = quantization
    backend = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig.from_dict(data))
    session = backend.session("s")
    session.extend(MESSAGES)
    session.check()
    prompt = session.format.generation_prompt_ids(session.messages)
    return session.continuation_logits(prompt)[-1]


@pytest.mark.parametrize(("bits", "tolerance"), [(4, 0.05), (2, 0.20)])
def test_attended_tier_logits_close_to_full_precision(
    tiny_model: Any, tiny_tokenizer: Any, bits: int, tolerance: float
) -> None:
    full = _last_logits(tiny_model, tiny_tokenizer, None)
    quant = _last_logits(
        tiny_model, tiny_tokenizer, {"attended_bits": bits, "group_size": 16, "attended_residual_tokens": 16}
    )
    err = float((quant - full).abs().max())
    scale = float(full.abs().max())
    assert err <= tolerance * scale, f"int{bits}: max |Δlogit| {err:.4f} vs max |logit| {scale:.4f}"
    assert int(quant.argmax()) == int(full.argmax())


def test_window_covering_everything_is_exact(tiny_model: Any, tiny_tokenizer: Any) -> None:
    full = _last_logits(tiny_model, tiny_tokenizer, None)
    window = {"attended_bits": 4, "attended_residual_tokens": 100_000}
    quant = _last_logits(tiny_model, tiny_tokenizer, window)
    assert torch.equal(quant, full)


def test_attended_tier_under_a_budget_keeps_invariants(tiny_model: Any, tiny_tokenizer: Any) -> None:
    config = AgentKVConfig.from_dict(
        {
            "policy": "lifecycle",
            "archive_tier": "drop",
            "budget": {"device_tokens": 40},
            "quantization": {"attended_bits": 4, "group_size": 16, "attended_residual_tokens": 16},
        }
    )
    backend = TransformersBackend(tiny_model, tiny_tokenizer, config)
    session = backend.session("b")
    history = list(MESSAGES[:2])
    session.extend(history)
    for turn in range(4):
        history = [*history, {"role": "user", "content": f"lorem ipsum dolor {turn} " * 8}]
        session.extend(history)
        session.check()
        child = session.fork(f"branch-{turn}")
        child.extend([*history, {"role": "assistant", "content": "consectetur adipiscing elit"}])
        child.check()
        backend.close(child.session_id)
    stats = session.stats()
    # Held bytes are the codes, statistics and window actually held, not slots * fp32 bytes.
    walked = sum(tensor_bytes(t) for t in session.store.physical.tensors())
    assert stats.device_bytes == walked
    assert stats.device_bytes < stats.attended_tokens * backend.runner.bytes_per_token
    assert session.generate(max_new_tokens=3) is not None


@pytest.mark.parametrize(
    ("quantization", "message"),
    [
        ({"attended_bits": 3}, "attended_bits"),
        ({"attended_bits": 8}, "attended_bits"),
        ({"attended_residual_tokens": -1}, "attended_residual_tokens"),
    ],
)
def test_bad_attended_config_is_a_clear_error(quantization: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AgentKVConfig.from_dict({"quantization": quantization})


def test_bad_attended_spec_names_allowed_values() -> None:
    with pytest.raises(ValueError, match=r"expected one of \[4, 2\], got 3"):
        check_attended_spec(3, 32, 8)
    with pytest.raises(ValueError, match="group_size: expected an int >= 1, got 0"):
        check_attended_spec(4, 0, 8)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 4 for 2-bit codes, got 6"):
        check_attended_spec(2, 32, 8, head_dim=6)
