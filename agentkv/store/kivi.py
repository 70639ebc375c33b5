"""KIVI codes: asymmetric round-to-nearest quantization of KV, packed into bytes.

The one quantizer of every quantized rung (`quantize_along`): the attended tier's
int4/int2 (`agentkv.store.attended` holds the layout), its 8-bit keys as two 4-bit
planes (`agentkv.store.key_planes`), and the int8/int4 archive and host codes
(`agentkv.store.quantized`). Keys per channel over groups of tokens, values per token
over groups of channels (Liu et al. 2024, https://arxiv.org/abs/2402.02750);
statistics in float16 (the archive keeps float32 ones for float32 KV), zero rounded
down and scale rounded up so the grid still covers each group.
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


def key_groups(k: torch.Tensor, group_size: int) -> torch.Tensor:
    """Keys `[B, H, n, D]` as float32 groups of `group_size` tokens, `[B, H, ceil(n / G), G, D]`.

    A last partial group is padded with a copy of its last token, which leaves its min
    and max unchanged.
    """
    b, h, n, d = k.shape
    num_groups = -(-n // group_size)
    pad = num_groups * group_size - n
    x = k.float()
    if pad:
        x = torch.cat([x, x[:, :, -1:].expand(b, h, pad, d)], dim=2)
    return x.reshape(b, h, num_groups, group_size, d)  # [B, H, n/G, G, D]


def value_groups(v: torch.Tensor, group_size: int) -> torch.Tensor:
    """Values `[B, H, n, D]` as float32 groups of channels, `[B, H, n, D / Gv, Gv]` (`value_group`)."""
    b, h, n, d = v.shape
    g = value_group(d, group_size)
    return v.float().reshape(b, h, n, d // g, g)


def key_codes(k: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, ...]:
    """Per-channel key quantization of `[B, H, n, D]` over runs of `group_size` tokens (`key_groups`), packed.

    The attended tier's layout (the public, checked quantizer is `agentkv.store.quantize_keys`).
    Returns codes `[B, H, n, D / p]`, scales and zeros `[B, H, ceil(n / G), D]` and the
    group of each token (`long [n]`).
    """
    b, h, n, d = k.shape
    codes, scales, zeros = quantize_along(key_groups(k, group_size), bits, dim=-2)
    codes = codes.reshape(b, h, -1, d)[:, :, :n]
    groups = torch.arange(n, dtype=_LONG) // group_size
    return pack_codes(codes, bits), scales, zeros, groups


def value_codes(v: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, ...]:
    """Per-token value quantization of `[B, H, n, D]` in groups of channels (`value_groups`), packed."""
    codes, scales, zeros = quantize_along(value_groups(v, group_size), bits, dim=-1)
    return pack_codes(codes.reshape(v.shape), bits), scales, zeros


def quantize_along(
    x: torch.Tensor, bits: int, dim: int, *, stat_dtype: torch.dtype = STAT_DTYPE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest along `dim`: `uint8` codes, and scales and zeros squeezed out of `dim`.

    The one KIVI quantizer of every quantized rung (attended int4/int2, the 8-bit key
    planes, the int8/int4 archive and the host tier's codes): `zero = min` rounded
    down and `scale = (max - zero) / (2**bits - 1)` rounded up when stored in a
    narrower `stat_dtype`, so the grid still covers the group and no code is clamped.
    A constant group has scale 0: its codes are 0 and dequantize to the zero exactly.

    Raises:
        ValueError: non-finite input, or statistics beyond `stat_dtype`'s range.
    """
    qmax = (1 << bits) - 1
    lo, hi = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    zeros = round_toward(lo, up=False, dtype=stat_dtype)
    scales = round_toward((hi - zeros.float()) / qmax, up=True, dtype=stat_dtype)
    if not (bool(torch.isfinite(zeros).all()) and bool(torch.isfinite(scales).all())):
        limit = torch.finfo(stat_dtype).max
        msg = f"cannot quantize: non-finite values, or beyond {stat_dtype} statistics (|x| <= {limit})"
        raise ValueError(msg)
    s, z = scales.float(), zeros.float()
    codes = ((x - z) / torch.where(s > 0, s, 1.0)).round_().clamp_(0, qmax).to(torch.uint8)
    return codes, scales.squeeze(dim), zeros.squeeze(dim)


def round_toward(x: torch.Tensor, *, up: bool, dtype: torch.dtype = STAT_DTYPE) -> torch.Tensor:
    """float32 → `dtype`, rounding up or down instead of to nearest (the grid keeps covering the group)."""
    y = x.to(dtype)
    if y.dtype == x.dtype:
        return y
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


def unpack_into(packed: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """`unpack_codes` written into `out` (`[..., D]`, any float dtype, may be a slice of a larger tensor).

    The codes are unpacked as bytes (a transient a quarter of `out`'s float32 size),
    then converted in one contiguous pass: converting each planar block into its
    strided slice of `out` instead costs about twice as much on a CPU (short inner
    loops), and unpacking bytes is cheap.
    """
    out.copy_(unpack_codes(packed, bits))


KeyBlock = tuple[int, int, int, int]
"""(first row, groups m, rows per group r, first group g): the `m * r` rows from `first` hold
groups `g` to `g + m - 1`, `r` consecutive rows each."""

MAX_KEY_BLOCKS = 16
"""Beyond this many blocks a run's key statistics are gathered per row (one kernel) instead."""


def key_blocks(groups: torch.Tensor) -> list[KeyBlock] | None:
    """The key groups of consecutive quantized rows (`long [n]`) as a few regular blocks; None if too many.

    Groups are formed over a span's tokens in order, so the rows of a group are
    consecutive and successive groups have successive ids: a run of full groups is
    one block (statistics broadcast over a `[m, r, D]` view, no per-row gather), a
    partial or thinned group is a block of its own. A layout that breaks into more
    than `MAX_KEY_BLOCKS` blocks (heavy thinning) is left to the per-row gather.
    """
    n = int(groups.numel())
    if n == 0:
        return []
    change = ((groups[1:] != groups[:-1]).nonzero().flatten() + 1).tolist()
    starts, ends = [0, *change], [*change, n]
    blocks: list[KeyBlock] = []
    for start, end, group in zip(starts, ends, groups[starts].tolist(), strict=True):
        if blocks:
            first, m, rows, g = blocks[-1]
            if end - start == rows and group == g + m:
                blocks[-1] = (first, m + 1, rows, g)
                continue
        if len(blocks) == MAX_KEY_BLOCKS:
            return None
        blocks.append((start, 1, end - start, group))
    return blocks


def dequantize_keys_into(
    out: torch.Tensor,
    packed: torch.Tensor,
    bits: int,
    stats: tuple[torch.Tensor, torch.Tensor],
    blocks: list[KeyBlock] | None,
    groups: torch.Tensor,
) -> None:
    """Keys of consecutive quantized rows into `out` `[B, H, n, D]`: code * scale + zero, in place.

    `packed` `uint8 [B, H, n, D / p]`; `stats` (scales, zeros) `[B, H, Gk, D]`, already in
    `out`'s dtype; `blocks` from `key_blocks(groups)`, or None to gather by `groups` (`long [n]`).
    The same arithmetic as a gather of the statistics, bit for bit.
    """
    scales, zeros = stats
    unpack_into(packed, bits, out)
    if blocks is None:
        index = groups.to(out.device)
        torch.addcmul(zeros.index_select(2, index), out, scales.index_select(2, index), out=out)
        return
    b, h, _, d = out.shape
    for first, m, rows, g in blocks:
        view = out.narrow(2, first, m * rows).view(b, h, m, rows, d)  # [B, H, m, r, D]
        scale = scales.narrow(2, g, m).unsqueeze(3)  # [B, H, m, 1, D]
        torch.addcmul(zeros.narrow(2, g, m).unsqueeze(3), view, scale, out=view)


def dequantize_values_into(
    out: torch.Tensor, packed: torch.Tensor, bits: int, stats: tuple[torch.Tensor, torch.Tensor]
) -> None:
    """Values of quantized rows into `out` `[B, H, n, D]`; `stats` `[B, H, n, D / Gv]` in `out`'s dtype.

    The statistics broadcast over the `Gv` channels of their group, the innermost axis.
    A CPU kernel vectorizes a pass with one such broadcast operand but not with two
    (`addcmul` then falls back to a scalar loop, about 4x slower), so in float32 on a
    CPU the read multiplies, then adds: code * scale is exact in float32 (an integer
    below 16 times a float16), so both passes round exactly as `addcmul` does. Other
    dtypes (float16 products are not exact) and devices take the one `addcmul`.
    """
    scales, zeros = stats
    unpack_into(packed, bits, out)
    view = out.view(*out.shape[:-1], int(scales.shape[-1]), -1)  # [B, H, n, D/Gv, Gv]
    scale, zero = scales.unsqueeze(-1), zeros.unsqueeze(-1)  # [B, H, n, D/Gv, 1]
    if out.device.type == "cpu" and out.dtype == torch.float32:
        view.mul_(scale).add_(zero)
    else:
        torch.addcmul(zero, view, scale, out=view)


def round_trip_keys(k: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """What `[B, H, n, D]` keys read back as after per-channel quantization at `bits` (1 to 8), float32."""
    b, h, n, d = k.shape
    codes, scales, zeros = quantize_along(key_groups(k, group_size), bits, dim=-2)
    out = codes.float() * scales.float().unsqueeze(-2) + zeros.float().unsqueeze(-2)  # [B, H, n/G, G, D]
    return out.reshape(b, h, -1, d)[:, :, :n]


def round_trip_values(v: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """What `[B, H, n, D]` values read back as after per-token quantization at `bits` (1 to 8), float32."""
    codes, scales, zeros = quantize_along(value_groups(v, group_size), bits, dim=-1)
    out = codes.float() * scales.float().unsqueeze(-1) + zeros.float().unsqueeze(-1)
    return out.reshape(v.shape)
