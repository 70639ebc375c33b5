"""Quantized (KIVI-style int8/int4) and host tiers: error bounds, exact byte accounting, ownership."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.store.block import KVBlock, tensor_bytes
from agentkv.store.host import HostBlock, HostMemoryError, check_host_limit
from agentkv.store.quantized import (
    ALLOWED_BITS,
    QuantizedBlock,
    QuantizedTensor,
    quantize_keys,
    quantize_values,
)

BITS = [8, 4]
GROUP_SIZES = [16, 32, 64]
TOKEN_COUNTS = [1, 7, 32, 100]
DTYPES = [torch.float32, torch.bfloat16]

# Keys group over tokens (dim 2), values over channels (dim 3).
KEY_DIM, VALUE_DIM = 2, 3


# --------------------------------------------------------------------------- helpers


def _held_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor a (nested) dataclass holds, found by walking its fields."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _held_tensors(getattr(obj, f.name))
    elif isinstance(obj, list | tuple):
        for item in obj:
            yield from _held_tensors(item)


def _assert_exact_accounting(obj: QuantizedTensor | QuantizedBlock | HostBlock) -> None:
    tensors = list(_held_tensors(obj))
    assert obj.nbytes == sum(t.numel() * t.element_size() for t in tensors)
    for t in tensors:
        # Each tensor owns exactly its bytes: no hidden padding, no view of a larger buffer.
        assert t.untyped_storage().nbytes() == tensor_bytes(t)


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float16 if dtype in (torch.float16, torch.bfloat16) else torch.float32


def _error_bound(x: torch.Tensor, dim: int, group_size: int, bits: int) -> torch.Tensor:
    """Per-element bound on |dequantize(quantize(x)) - x|, from each group's own min/max.

    Round-to-nearest on a grid of step `range / (2**bits - 1)` errs by at most half a
    step. The eps terms: the stored scale/zero are rounded outward to their dtype (one
    ulp relative, or the smallest subnormal absolute), float32 arithmetic, and the final
    rounding of the output to `x.dtype` (half an ulp of the value).
    """
    qmax = 2**bits - 1
    xf = x.float()
    stat = _stat_dtype(x.dtype)
    stat_eps = torch.finfo(stat).eps
    tiny = 2.0**-24 if stat == torch.float16 else 0.0
    out_eps = torch.finfo(x.dtype).eps
    f32_eps = torch.finfo(torch.float32).eps
    bound = torch.empty_like(xf)
    length = x.shape[dim]
    for start in range(0, length, group_size):
        g = xf.narrow(dim, start, min(group_size, length - start))
        lo, hi = g.amin(dim, keepdim=True), g.amax(dim, keepdim=True)
        rng, absmax = hi - lo, g.abs().amax(dim, keepdim=True)
        half_step = rng / qmax / 2
        eps = (
            (rng + absmax) * (2 * stat_eps + 8 * f32_eps)  # outward-rounded stats, fp32 math
            + (absmax + half_step) * out_eps / 2  # rounding of the output dtype
            + 2 * tiny
            + 1e-30
        )
        bound.narrow(dim, start, g.shape[dim]).copy_((half_step + eps).expand_as(g))
    return bound


def _make_block(layers: int, n: int, *, dtype: torch.dtype = torch.float32, seed: int = 0) -> KVBlock:
    gen = torch.Generator().manual_seed(seed)
    keys = [torch.randn(1, 3, n, 64, generator=gen).to(dtype) for _ in range(layers)]
    values = [torch.randn(1, 3, n, 64, generator=gen).to(dtype) for _ in range(layers)]
    return KVBlock(keys=keys, values=values, offsets=list(range(100, 100 + n)))


# --------------------------------------------------------------------------- quantized tensors


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", TOKEN_COUNTS)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("bits", BITS)
def test_round_trip_within_bound(bits: int, group_size: int, n: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + group_size + bits)
    # An outlier channel in the keys, as KIVI observes: per-channel groups keep it local.
    k = torch.randn(2, 3, n, 64, generator=gen)
    k[..., 5] *= 20
    v = torch.randn(2, 3, n, 64, generator=gen)
    k, v = k.to(dtype), v.to(dtype)

    for x, quantize, dim in ((k, quantize_keys, KEY_DIM), (v, quantize_values, VALUE_DIM)):
        q = quantize(x, bits, group_size)
        out = q.dequantize()
        assert out.shape == x.shape
        assert out.dtype == dtype
        assert out.is_contiguous()
        assert q.scales.dtype == q.zeros.dtype == _stat_dtype(dtype)
        err = (out.float() - x.float()).abs()
        bound = _error_bound(x, dim, group_size, bits)
        worst = (err - bound).max().item()
        assert worst <= 0, f"error exceeds bound by {worst}"
        _assert_exact_accounting(q)


@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("n", TOKEN_COUNTS)
def test_int4_data_is_half_of_int8(n: int, group_size: int) -> None:
    x = torch.randn(1, 3, n, 64)
    for quantize in (quantize_keys, quantize_values):
        q8, q4 = quantize(x, 8, group_size), quantize(x, 4, group_size)
        assert tensor_bytes(q8.data) == x.numel()
        assert tensor_bytes(q4.data) == math.ceil(x.numel() / 2)
        # Statistics do not depend on the bit width.
        assert tensor_bytes(q4.scales) + tensor_bytes(q4.zeros) == tensor_bytes(q8.scales) + tensor_bytes(
            q8.zeros
        )


def test_stat_counts_follow_kivi_grouping() -> None:
    x = torch.randn(2, 3, 100, 64)
    qk = quantize_keys(x, 8, 32)
    qv = quantize_values(x, 8, 32)
    # keys: one (scale, zero) per (b, h, channel, token group): ceil(100 / 32) = 4 groups.
    assert qk.scales.shape == (2, 3, 64, 4)
    # values: one per (b, h, token, channel group): 64 / 32 = 2 groups.
    assert qv.scales.shape == (2, 3, 100, 2)


def test_odd_int4_count_packs_one_half_byte() -> None:
    x = torch.randn(1, 1, 3, 5)  # 15 codes -> 8 bytes
    q = quantize_values(x, 4, 4)
    assert q.data.numel() == 8
    assert q.dequantize().shape == x.shape


def test_constant_groups_are_exact() -> None:
    x = torch.full((1, 2, 37, 16), 0.3)
    for bits in BITS:
        for quantize in (quantize_keys, quantize_values):
            assert torch.equal(quantize(x, bits, 16).dequantize(), x)


def test_empty_token_dimension() -> None:
    x = torch.randn(1, 3, 0, 64)
    for quantize in (quantize_keys, quantize_values):
        q = quantize(x, 4, 32)
        assert q.nbytes == 0
        assert q.dequantize().shape == x.shape


@pytest.mark.parametrize("bits", [0, 1, 2, 3, 5, 16, 32, True])
def test_bad_bits_raise(bits: int) -> None:
    x = torch.randn(1, 1, 4, 8)
    for call in (
        lambda: quantize_keys(x, bits, 4),
        lambda: quantize_values(x, bits, 4),
        lambda: QuantizedBlock.from_block(_make_block(1, 4), bits, 4),
    ):
        with pytest.raises(ValueError, match=r"bits must be one of \[8, 4\]"):
            call()
    assert ALLOWED_BITS == (8, 4)


@pytest.mark.parametrize("group_size", [0, -3, 2.5, True])
def test_bad_group_size_raises(group_size: Any) -> None:
    with pytest.raises(ValueError, match="group_size"):
        quantize_keys(torch.randn(1, 1, 4, 8), 8, group_size)


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match=r"\[B, H, n, D\]"):
        quantize_keys(torch.randn(4, 8), 8, 4)
    with pytest.raises(TypeError, match="floating point"):
        quantize_values(torch.ones(1, 1, 4, 8, dtype=torch.int64), 8, 4)
    # bfloat16 input stores float16 statistics: a range beyond float16 is refused, not silently inf.
    with pytest.raises(ValueError, match="float32"):
        quantize_keys(torch.tensor([[[[1e6], [-1e6]]]], dtype=torch.bfloat16), 8, 4)
    with pytest.raises(ValueError, match="non-finite"):
        quantize_values(torch.tensor([[[[math.nan, 1.0]]]]), 8, 4)


@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    n=st.integers(0, 70),
    d=st.integers(1, 40),
    bits=st.sampled_from(BITS),
    group_size=st.integers(1, 48),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    magnitude=st.sampled_from([1e-3, 1.0, 50.0]),
    seed=st.integers(0, 2**16),
)
def test_random_shapes(
    b: int,
    h: int,
    n: int,
    d: int,
    bits: int,
    group_size: int,
    dtype: torch.dtype,
    magnitude: float,
    seed: int,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(b, h, n, d, generator=gen) * magnitude + magnitude / 3).to(dtype)
    for quantize, dim in ((quantize_keys, KEY_DIM), (quantize_values, VALUE_DIM)):
        q = quantize(x, bits, group_size)
        out = q.dequantize()
        assert out.shape == x.shape and out.dtype == dtype
        assert bool(((out.float() - x.float()).abs() <= _error_bound(x, dim, group_size, bits)).all())
        _assert_exact_accounting(q)
        codes = x.numel()
        assert q.data.numel() == (codes if bits == 8 else math.ceil(codes / 2))


# --------------------------------------------------------------------------- quantized blocks


@pytest.mark.parametrize("residual", [0, 1, 5, 32, 200])
@pytest.mark.parametrize("bits", BITS)
def test_block_round_trip_and_residual_exact(bits: int, residual: int) -> None:
    block = _make_block(layers=3, n=45, dtype=torch.bfloat16)
    qb = QuantizedBlock.from_block(block, bits, 16, residual_tokens=residual)
    r = min(residual, 45)
    assert qb.num_tokens == 45 and qb.residual_tokens == r
    assert qb.offsets == block.offsets
    assert (qb.residual_keys is None) == (r == 0)
    _assert_exact_accounting(qb)

    out = qb.to_block()
    assert out.offsets == block.offsets
    for layer in range(3):
        for got, want, dim in (
            (out.keys[layer], block.keys[layer], KEY_DIM),
            (out.values[layer], block.values[layer], VALUE_DIM),
        ):
            assert got.shape == want.shape and got.dtype == want.dtype
            assert torch.equal(got[:, :, 45 - r :], want[:, :, 45 - r :])  # residual: exact
            head = want[:, :, : 45 - r]
            err = (got[:, :, : 45 - r].float() - head.float()).abs()
            assert bool((err <= _error_bound(head, dim, 16, bits)).all())


def test_block_does_not_keep_source_alive() -> None:
    block = _make_block(layers=2, n=40)
    qb = QuantizedBlock.from_block(block, 8, 16, residual_tokens=8)
    source_ptrs = {t.untyped_storage().data_ptr() for t in block.keys + block.values}
    for t in _held_tensors(qb):
        assert t.untyped_storage().data_ptr() not in source_ptrs


def test_to_block_dtype_and_device() -> None:
    qb = QuantizedBlock.from_block(_make_block(layers=2, n=20), 4, 16, residual_tokens=3)
    out = qb.to_block(device="cpu", dtype=torch.float16)
    assert all(t.dtype == torch.float16 and t.device.type == "cpu" for t in out.keys + out.values)
    moved = qb.to("cpu")
    assert moved.nbytes == qb.nbytes
    assert torch.equal(moved.to_block().keys[0], qb.to_block().keys[0])


def test_block_validation() -> None:
    block = _make_block(layers=1, n=10)
    with pytest.raises(ValueError, match="residual_tokens"):
        QuantizedBlock.from_block(block, 8, 16, residual_tokens=-1)
    bad = KVBlock(keys=block.keys, values=block.values, offsets=list(range(9)))
    with pytest.raises(
        ValueError, match=r"expected \[B, H, 9, D\] \(n = len\(offsets\)\), got \[1, 3, 10, 64\]"
    ):
        QuantizedBlock.from_block(bad, 8, 16)


def test_compression_ratio_30_layer_block() -> None:
    """Bytes of a SmolLM2-shaped block (30 layers, 3 KV heads, head dim 64), group 32.

    Per element: `bits / 8` bytes of code plus a scale and a zero per 32 elements.
    fp32 input keeps fp32 statistics: int8 = (1 + 8/32) / 4 = 0.3125, int4 = (0.5 + 8/32) / 4
    = 0.1875 of fp32. Half-precision input keeps float16 statistics: int8 = (1 + 4/32) / 4
    = 0.28125, int4 = (0.5 + 4/32) / 4 = 0.15625 of the same tokens in fp32.
    """
    g, n = 32, 256
    block32 = _make_block(layers=30, n=n)
    block16 = _make_block(layers=30, n=n, dtype=torch.bfloat16)
    fp32_bytes = block32.nbytes
    assert fp32_bytes == 30 * 2 * 3 * n * 64 * 4

    ratios: dict[tuple[str, int], float] = {}
    for name, block, stat_bytes in (("fp32", block32, 4), ("bf16", block16, 2)):
        for bits in BITS:
            qb = QuantizedBlock.from_block(block, bits, g)
            ratio = qb.nbytes / fp32_bytes
            assert ratio == pytest.approx((bits / 8 + 2 * stat_bytes / g) / 4, rel=1e-12)
            ratios[name, bits] = ratio
    assert ratios["fp32", 8] < 0.32  # 0.3125: fp32 statistics cost 0.25 byte per element at g=32
    assert ratios["fp32", 4] < 0.2  # 0.1875
    assert ratios["bf16", 8] < 0.3  # 0.28125
    assert ratios["bf16", 4] < 0.2  # 0.15625


# --------------------------------------------------------------------------- host tier


def test_host_round_trip_exact_and_owns_storage() -> None:
    # The block's tensors are views of a larger "physical cache", as after index_select-free slicing.
    cache_k = torch.randn(1, 3, 50, 64, dtype=torch.bfloat16)
    cache_v = torch.randn(1, 3, 50, 64, dtype=torch.bfloat16)
    block = KVBlock(keys=[cache_k[:, :, 10:30]], values=[cache_v[:, :, 10:30]], offsets=list(range(20)))

    host = HostBlock.offload(block)
    assert host.num_tokens == 20
    assert host.nbytes == block.nbytes == 2 * 3 * 20 * 64 * 2
    _assert_exact_accounting(host)
    for src, dst in zip(block.keys + block.values, host.block.keys + host.block.values, strict=True):
        assert torch.equal(src, dst)
        assert dst.device.type == "cpu"
        assert dst.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()

    restored = host.restore("cpu")
    assert restored.offsets == block.offsets
    for src, got, held in zip(
        block.keys + block.values,
        restored.keys + restored.values,
        host.block.keys + host.block.values,
        strict=True,
    ):
        assert torch.equal(src, got)
        assert got.untyped_storage().data_ptr() != held.untyped_storage().data_ptr()


def test_host_copy_is_independent_of_source() -> None:
    block = _make_block(layers=2, n=8)
    host = HostBlock.offload(block)
    block.keys[0].zero_()  # the device cache reuses its memory
    assert not torch.equal(host.block.keys[0], block.keys[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_offload_from_cuda_is_pinned() -> None:  # pragma: no cover - GPU only
    block = _make_block(layers=2, n=33).to("cuda")
    host = HostBlock.offload(block)
    for src, dst in zip(block.keys + block.values, host.block.keys + host.block.values, strict=True):
        assert dst.is_pinned() and dst.device.type == "cpu"
        assert torch.equal(src.cpu(), dst)
    restored = host.restore("cuda")
    assert all(torch.equal(a, b) for a, b in zip(restored.keys, block.keys, strict=True))


def test_check_host_limit() -> None:
    check_host_limit(10, 5, None)
    check_host_limit(10, 5, 15)
    with pytest.raises(
        HostMemoryError, match=r"10 bytes held \+ 6 bytes to add = 16 bytes.*limit_bytes=15"
    ) as info:
        check_host_limit(10, 6, 15)
    assert isinstance(info.value, RuntimeError)
    assert (info.value.current, info.value.adding, info.value.limit) == (10, 6, 15)
    with pytest.raises(ValueError, match="adding must be >= 0"):
        check_host_limit(0, -1, 10)
