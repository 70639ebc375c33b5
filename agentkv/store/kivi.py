"""KIVI codes: asymmetric round-to-nearest int4/int2 quantization of KV, packed into bytes.

The arithmetic of the attended quantized tier (`agentkv.store.attended` holds the
layout): keys per channel over groups of tokens, values per token over groups of
channels (Liu et al. 2024, https://arxiv.org/abs/2402.02750); statistics in float16,
zero rounded down and scale rounded up so the grid still covers each group.
"""

from __future__ import annotations

import math

import torch

STAT_DTYPE = torch.float16
"""Scales and zero points are held in float16."""

_LONG = torch.long


def value_group(head_dim: int, group_size: int) -> int:
    """Channels per value group: `group_size`, capped at the head dim, dividing it."""
    g = min(group_size, head_dim)
    while head_dim % g:
        g -= 1
    return g


def quantize_keys(k: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, ...]:
    """Per-channel key quantization of `[B, H, n, D]` over runs of `group_size` tokens.

    Returns codes `[B, H, n, D / p]`, scales and zeros `[B, H, ceil(n / G), D]` and the
    group of each token (`long [n]`). A last partial group is padded with a copy of its
    last token, which leaves its min and max unchanged.
    """
    b, h, n, d = k.shape
    num_groups = -(-n // group_size)
    pad = num_groups * group_size - n
    x = k.float()
    if pad:
        x = torch.cat([x, x[:, :, -1:].expand(b, h, pad, d)], dim=2)
    grouped = x.reshape(b, h, num_groups, group_size, d)  # [B, H, n/G, G, D]
    codes, scales, zeros = quantize_along(grouped, bits, dim=-2)
    codes = codes.reshape(b, h, num_groups * group_size, d)[:, :, :n]
    groups = torch.arange(n, dtype=_LONG) // group_size
    return pack_codes(codes, bits), scales, zeros, groups


def quantize_values(v: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, ...]:
    """Per-token value quantization of `[B, H, n, D]` in groups of channels."""
    b, h, n, d = v.shape
    g = value_group(d, group_size)
    grouped = v.float().reshape(b, h, n, d // g, g)  # [B, H, n, D/Gv, Gv]
    codes, scales, zeros = quantize_along(grouped, bits, dim=-1)
    return pack_codes(codes.reshape(b, h, n, d), bits), scales, zeros


def quantize_along(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest along `dim`; statistics squeezed out of `dim`, float16."""
    qmax = (1 << bits) - 1
    lo, hi = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    zeros = round_toward(lo, up=False)
    scales = round_toward((hi - zeros.float()) / qmax, up=True)
    if not (bool(torch.isfinite(zeros).all()) and bool(torch.isfinite(scales).all())):
        msg = "cannot quantize: non-finite KV values or values beyond the float16 range of the statistics"
        raise ValueError(msg)
    s, z = scales.float(), zeros.float()
    codes = ((x - z) / torch.where(s > 0, s, 1.0)).round_().clamp_(0, qmax).to(torch.uint8)
    return codes, scales.squeeze(dim), zeros.squeeze(dim)


def round_toward(x: torch.Tensor, *, up: bool) -> torch.Tensor:
    """float32 → float16, rounding up or down instead of to nearest (the grid keeps covering the group)."""
    y = x.to(STAT_DTYPE)
    target = torch.full_like(y, float("inf") if up else float("-inf"))
    wrong_side = y.float() < x if up else y.float() > x
    return torch.where(wrong_side, torch.nextafter(y, target), y)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack `uint8 [..., D]` codes of `bits` each into `[..., D * bits / 8]` bytes, planar.

    Byte j holds channels j, j + D/p, j + 2D/p, ... (lowest bits first, p codes per
    byte), so unpacking is a few whole-tensor shifts and one concatenation of
    contiguous blocks rather than an interleave.
    """
    per = 8 // bits
    width = codes.shape[-1] // per
    out = codes[..., :width].clone()
    for i in range(1, per):
        out |= codes[..., i * width : (i + 1) * width] << (bits * i)
    return out


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_codes`: `uint8 [..., D]`."""
    per = 8 // bits
    mask = (1 << bits) - 1
    parts = [packed & mask, *((packed >> (bits * i)) & mask for i in range(1, per - 1))]
    return torch.cat([*parts, packed >> (bits * (per - 1))], dim=-1)


def token_bytes(
    batch: int,
    kv_heads: int,
    head_dim: int,
    *,
    bits: int,
    key_bits: int,
    group_size: int,
    tokens: int,
    amortized: bool = False,
) -> int:
    """Bytes `tokens` slots of one layer take quantized as one set: codes plus statistics.

    Keys: `key_bits` per element and one (scale, zero) per channel per group of
    `group_size` tokens (a last partial group has its own); values: `bits` per element
    and one (scale, zero) per token per group of channels. `amortized`: the key
    statistics counted as a share of full groups (what tokens cost inside a long
    span, rounded up), for planning; otherwise exactly what quantizing this set holds.
    """
    stat = STAT_DTYPE.itemsize
    rows = batch * kv_heads
    codes = tokens * rows * head_dim * (key_bits + bits) // 8
    value_stats = 2 * tokens * rows * (head_dim // value_group(head_dim, group_size)) * stat
    per_group = 2 * rows * head_dim * stat  # one scale and one zero per channel
    groups = tokens / group_size if amortized else -(-tokens // group_size)
    key_stats = math.ceil(groups * per_group)
    return codes + value_stats + key_stats
