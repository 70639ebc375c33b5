"""One KIVI quantizer serves every quantized rung: `kivi.quantize_along`.

Known values of the arithmetic, its round trip, and the archive tier (int8/int4 blocks,
host codes) and the attended tier (int4/int2) holding exactly its codes and statistics.
(The archive tier's own copy of this arithmetic was checked bit for bit against it,
codes, statistics and dequantized blocks, before it was removed.)
"""

from __future__ import annotations

import pytest
import torch

from agentkv.store import kivi, quantized
from agentkv.store.kivi import quantize_along, round_toward, unpack_codes


def test_known_values() -> None:
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0], [5.0, 5.0, 5.0, 5.0]])
    codes, scales, zeros = quantize_along(x, 2, -1, stat_dtype=torch.float32)
    assert codes.tolist() == [[0, 1, 2, 3], [0, 0, 0, 0]]  # a constant group: scale 0, codes 0
    assert scales.tolist() == [1.0, 0.0] and zeros.tolist() == [0.0, 5.0]
    codes, scales, zeros = quantize_along(torch.tensor([[0.0, 0.1, 0.2]]), 8, -1)
    assert scales.dtype == torch.float16 and float(scales[0]) * 255 >= 0.2  # rounded up: covers the max
    assert codes.tolist() == [[0, 127, 255]]  # 0.1 is just under 127.5 steps of the rounded-up scale


@pytest.mark.parametrize("stat_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_round_trip_is_within_half_a_step(bits: int, stat_dtype: torch.dtype) -> None:
    torch.manual_seed(bits)
    x = torch.randn(2, 3, 5, 16) * 3
    codes, scales, zeros = quantize_along(x, bits, -1, stat_dtype=stat_dtype)
    back = codes.float() * scales.float().unsqueeze(-1) + zeros.float().unsqueeze(-1)
    assert bool(((back - x).abs() <= scales.float().unsqueeze(-1) / 2 + 1e-6).all())
    assert torch.equal(round_toward(x, up=True, dtype=torch.float32), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
def test_the_archive_tier_holds_the_shared_quantizers_codes(bits: int, dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    v = torch.randn(1, 2, 7, 16).to(dtype)  # values: groups of channels
    held = quantized.quantize_values(v, bits, 8)
    stat = torch.float16 if dtype is torch.bfloat16 else torch.float32
    codes, scales, zeros = quantize_along(v.float().reshape(1, 2, 7, 2, 8), bits, -1, stat_dtype=stat)
    assert torch.equal(held.scales, scales) and torch.equal(held.zeros, zeros)
    assert torch.equal(quantized._unpack(held.data, bits, codes.numel()), codes.reshape(-1))


def test_the_attended_tier_holds_the_shared_quantizers_codes() -> None:
    torch.manual_seed(5)
    k = torch.randn(1, 2, 64, 16)
    packed, scales, zeros, groups = kivi.key_codes(k, 4, 32)
    codes, want_scales, want_zeros = quantize_along(k.reshape(1, 2, 2, 32, 16), 4, -2)
    assert torch.equal(scales, want_scales) and torch.equal(zeros, want_zeros)
    assert torch.equal(unpack_codes(packed, 4), codes.reshape(1, 2, 64, 16))
    assert groups.tolist() == [i // 32 for i in range(64)]
