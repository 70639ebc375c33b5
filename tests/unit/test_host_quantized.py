"""`quantization.host_bits`: the host archive held as int8 / int4 codes instead of fp32.

A host copy at full precision costs the span's whole fp32 KV; int8 codes cost about a
quarter of it (plus scales), int4 about an eighth. The copy restores with the quantized
tier's error bound; the default (null) stays exact.
"""

from __future__ import annotations

import pytest
import torch

from agentkv import AgentKVConfig, TransformersBackend
from agentkv.spans import SpanState, Tier
from agentkv.store.block import KVBlock, tensor_bytes
from agentkv.store.host import HostBlock
from agentkv.store.quantized import QuantizedBlock


def make_block(layers: int = 3, n: int = 70) -> KVBlock:
    torch.manual_seed(0)
    keys = [torch.randn(1, 3, n, 64) for _ in range(layers)]
    values = [torch.randn(1, 3, n, 64) for _ in range(layers)]
    return KVBlock(keys=keys, values=values, offsets=list(range(n)))


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_host_copy_costs_a_fraction_and_restores_within_the_tier_error(bits: int) -> None:
    block = make_block()
    host = HostBlock.offload_quantized(block, bits=bits, group_size=32, residual_tokens=6)
    assert isinstance(host.block, QuantizedBlock) and host.bits == bits
    assert host.num_tokens == 70 and host.offsets == block.offsets
    # Codes + fp32 statistics for 64 tokens, the last 6 exact: (bits/8 + 8/32) / 4 of fp32, plus the residual.
    expected = QuantizedBlock.from_block(block, bits, 32, residual_tokens=6).nbytes
    assert host.nbytes == expected == pytest.approx(block.nbytes * (64 / 70 * (bits / 8 + 0.25) / 4 + 6 / 70))
    tensors = [
        t for layer in host.block.keys + host.block.values for t in (layer.data, layer.scales, layer.zeros)
    ]
    tensors += [*(host.block.residual_keys or []), *(host.block.residual_values or [])]
    assert all(t.device.type == "cpu" for t in tensors)
    assert host.nbytes == sum(tensor_bytes(t) for t in tensors)

    restored = host.restore("cpu")
    assert restored.offsets == block.offsets
    for got, want in zip(restored.keys + restored.values, block.keys + block.values, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(got[:, :, 64:], want[:, :, 64:])  # the residual tokens are exact
        step = (want.amax() - want.amin()) / (2**bits - 1)
        assert float((got - want).abs().max()) <= float(step)  # within a step of the widest group
    assert HostBlock.offload(block).bits is None


def archive_run(tiny_model, tiny_tokenizer, host_bits: int | None) -> tuple[TransformersBackend, list]:
    config = AgentKVConfig.from_dict(
        {
            "budget": {"device_tokens": 160, "low_watermark": 0.7},
            "archive_tier": "host",
            "quantization": {"attended_bits": None, "host_bits": host_bits},
        }
    )
    backend = TransformersBackend(tiny_model, tiny_tokenizer, config)
    session = backend.session("t")
    history = [{"role": "system", "content": "You are a helpful assistant."}]
    for i in range(6):
        history.append({"role": "user", "content": f"note {i}: the secret code is 44{i}7 lorem ipsum dolor"})
        history.append({"role": "assistant", "content": f"noted {i}"})
        session.extend(history)
        session.check()
    return backend, history


def test_session_archives_to_host_quantized_when_asked(tiny_model, tiny_tokenizer) -> None:
    full_backend, _ = archive_run(tiny_model, tiny_tokenizer, None)
    int8_backend, history = archive_run(tiny_model, tiny_tokenizer, 8)
    full, int8 = full_backend.get("t"), int8_backend.get("t")
    archived = [(s.span_id, s.held_tokens) for s in full.spans if s.state is SpanState.ARCHIVED]
    assert archived and archived == [
        (s.span_id, s.held_tokens) for s in int8.spans if s.state is SpanState.ARCHIVED
    ]
    assert all(s.tier is Tier.HOST for s in int8.spans if s.state is SpanState.ARCHIVED)
    full_host, int8_host = full.stats().host_bytes, int8.stats().host_bytes
    assert 0 < int8_host < 0.5 * full_host  # short spans (partial key groups) cost more than 1/4
    assert int8.stats().device_bytes == full.stats().device_bytes
    # A recalled span comes back from the int8 host copy, attended again; the cache stays consistent.
    target = next(s for s in int8.spans if s.state is SpanState.ARCHIVED and s.kind.value == "user")
    fact = tiny_tokenizer.decode(target.token_ids, skip_special_tokens=True).split("code is ")[1].split()[0]
    history.append({"role": "user", "content": f"which note had code {fact}?"})
    int8.extend(history)
    assert target.tier is Tier.DEVICE
    int8.check()
    assert int8.generate(max_new_tokens=2) is not None


def test_host_bits_in_yaml() -> None:
    config = AgentKVConfig.from_yaml_text("agentkv:\n  quantization:\n    host_bits: 8\n")
    assert config.quantization.host_bits == 8
    with pytest.raises(ValueError, match=r"agentkv.quantization.host_bits: unknown value 16; allowed: 8, 4"):
        AgentKVConfig.from_yaml_text("agentkv:\n  quantization:\n    host_bits: 16\n")
