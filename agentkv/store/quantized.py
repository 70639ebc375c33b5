"""The quantized tier: KIVI-style asymmetric int8 / int4 KV quantization.

KIVI (Liu et al. 2024, https://arxiv.org/abs/2402.02750) observes that key caches
have a few outlier *channels* (a channel is large for every token), while value
caches have no fixed outlier pattern and are consumed token by token (attention
weights mix whole value rows). So:

- keys are quantized **per channel**: the min/max statistics are taken over groups
  of `group_size` consecutive tokens, separately for every (batch, head, channel);
  an outlier channel then only widens its own quantization step;
- values are quantized **per token**: statistics over groups of `group_size`
  consecutive channels within one token, so the error of a value row stays local
  to that row.

Both use the one KIVI quantizer of every quantized rung (`agentkv.store.kivi.quantize_along`):
asymmetric round-to-nearest, `q = round((x - zero) / scale)` with `zero = min` and
`scale = (max - min) / (2**bits - 1)` per group, `x ≈ q * scale + zero`; codes are packed
with `kivi.pack_codes` (int4: two per byte). Scales and zero points are stored in float16
when the input is float16/bfloat16 (as KIVI does: they are a noticeable part of the
bytes at small group sizes) and in float32 otherwise. When they are stored in
float16, the zero point is rounded *down* and the scale *up*, so the quantization
grid still covers `[min, max]` and no code is clamped: the error stays within half
a (stored) step, exactly the bound round-to-nearest promises.

A token count that is not a multiple of `group_size` is handled by padding the last
group internally with a copy of its last element (which leaves its min/max
unchanged); only the codes of the real elements are stored (plus at most half a
byte of int4 packing), so `nbytes` is exact.

Like KIVI, a `QuantizedBlock` can keep its most recent `residual_tokens` tokens in
full precision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from agentkv.store.block import KVBlock, tensor_bytes
from agentkv.store.kivi import pack_codes, quantize_along, unpack_codes

ALLOWED_BITS: tuple[int, ...] = (8, 4)
"""Bit widths the quantized tier supports."""

_HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """One tensor quantized in groups along one dimension.

    The codes are stored with the grouped dimension moved last (`lead + [length]`,
    `lead` being `shape` without `dim`) and flattened; `scales` and `zeros` have shape
    `lead + [num_groups]`.
    """

    data: torch.Tensor
    """Packed codes, `uint8`, 1-D: one code per byte (int8) or two per byte (int4, `kivi.pack_codes`)."""
    scales: torch.Tensor
    """Per group step size, `lead + [num_groups]`, float16 or float32."""
    zeros: torch.Tensor
    """Per group zero point (the group minimum), same shape and dtype as `scales`."""
    bits: int
    """Code width: 8 or 4."""
    group_size: int
    """Number of consecutive elements along `dim` that share one scale and zero point."""
    dim: int
    """Dimension along which groups are formed: 2 (tokens) for keys, 3 (channels) for values."""
    shape: tuple[int, ...]
    """Shape of the original tensor."""
    dtype: torch.dtype
    """Dtype of the original tensor; `dequantize` returns it by default."""

    @property
    def device(self) -> torch.device:
        """Device the quantized data lives on."""
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Exact bytes of every tensor held (codes, scales and zero points)."""
        return tensor_bytes(self.data) + tensor_bytes(self.scales) + tensor_bytes(self.zeros)

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> QuantizedTensor:
        """Move the quantized data (not a dequantized copy) to another device."""
        return QuantizedTensor(
            data=self.data.to(device, non_blocking=non_blocking),
            scales=self.scales.to(device, non_blocking=non_blocking),
            zeros=self.zeros.to(device, non_blocking=non_blocking),
            bits=self.bits,
            group_size=self.group_size,
            dim=self.dim,
            shape=self.shape,
            dtype=self.dtype,
        )

    def dequantize(self, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Reconstruct the tensor, on the device of the quantized data.

        Args:
            dtype: Output dtype; defaults to the original dtype.

        Returns:
            A new contiguous tensor of shape `shape`.
        """
        length = self.shape[self.dim]
        lead = self.shape[: self.dim] + self.shape[self.dim + 1 :]
        num_groups = self.scales.shape[-1]
        codes = _unpack(self.data, self.bits, math.prod(lead) * length)
        codes = codes.reshape(*lead, length).float()  # [..., L]
        pad = num_groups * self.group_size - length
        if pad:
            codes = torch.nn.functional.pad(codes, (0, pad))
        grouped = codes.reshape(*lead, num_groups, self.group_size)  # [..., num_groups, G]
        out = grouped * self.scales.float().unsqueeze(-1) + self.zeros.float().unsqueeze(-1)
        out = out.reshape(*lead, num_groups * self.group_size)[..., :length]  # [..., L]
        return out.movedim(-1, self.dim).to(dtype or self.dtype).contiguous()


def quantize_keys(k: torch.Tensor, bits: int, group_size: int) -> QuantizedTensor:
    """Quantize keys per channel (KIVI): groups of `group_size` consecutive tokens.

    Args:
        k: Keys, `[B, H, n, D]`, floating point.
        bits: 8 or 4.
        group_size: Tokens per group; `n` need not be a multiple of it.

    Returns:
        The quantized keys, with one scale/zero per (b, h, token group, channel).

    Raises:
        ValueError: Bad `bits`, `group_size` or shape, or statistics that do not fit float16.
        TypeError: `k` is not floating point.
    """
    _check_4d(k, "k")
    return _quantize_groups(k, dim=2, bits=bits, group_size=group_size)


def quantize_values(v: torch.Tensor, bits: int, group_size: int) -> QuantizedTensor:
    """Quantize values `[B, H, n, D]` per token (KIVI): one scale/zero per (b, h, token, group of channels).

    `group_size` channels per group (`D` need not be a multiple of it); bits and errors as `quantize_keys`.
    """
    _check_4d(v, "v")
    return _quantize_groups(v, dim=3, bits=bits, group_size=group_size)


@dataclass(eq=False)
class QuantizedBlock:
    """A `KVBlock` held in the quantized tier, on the device of its source.

    Token `i` of the block is `offsets[i]`; the first `num_tokens - residual_tokens`
    tokens are quantized, the last `residual_tokens` are kept in full precision.
    """

    keys: list[QuantizedTensor]
    """Per layer, quantized keys of the first `num_tokens - residual_tokens` tokens."""
    values: list[QuantizedTensor]
    """Per layer, quantized values of the same tokens."""
    offsets: list[int]
    """Offsets within the span of all the block's tokens, in the order they are stored."""
    residual_keys: list[torch.Tensor] | None = None
    """Per layer, full-precision keys of the last tokens, `[B, H_kv, r, D]`; None when r = 0."""
    residual_values: list[torch.Tensor] | None = None
    """Per layer, full-precision values of the last tokens, `[B, H_kv, r, D]`; None when r = 0."""

    @classmethod
    def from_block(
        cls, block: KVBlock, bits: int, group_size: int, residual_tokens: int = 0
    ) -> QuantizedBlock:
        """Quantize a block, keeping its last `residual_tokens` tokens in full precision.

        Per-channel key statistics cost a scale and a zero per channel per token group,
        however few tokens the group holds: quantizing a block much shorter than
        `group_size` can take *more* bytes than full precision (one fp32 token at int8:
        1 code byte + 8 statistic bytes per key element, against 4). KIVI keeps such a
        partial group in full precision; `residual_tokens=block.num_tokens % group_size`
        does the same.

        Args:
            block: The block; its tensors are read, not modified or kept.
            bits: 8 or 4.
            group_size: Group size for both keys (tokens) and values (channels).
            residual_tokens: Number of trailing tokens to keep exactly (capped at the block size).

        Returns:
            The quantized block, on the block's device.

        Raises:
            ValueError: Bad arguments or tensor shapes.
        """
        _check_bits(bits)
        _check_group_size(group_size)
        if isinstance(residual_tokens, bool) or not isinstance(residual_tokens, int) or residual_tokens < 0:
            msg = f"residual_tokens must be an int >= 0, got {residual_tokens!r}"
            raise ValueError(msg)
        n = block.num_tokens
        r = min(residual_tokens, n)
        q = n - r
        keys: list[QuantizedTensor] = []
        values: list[QuantizedTensor] = []
        res_k: list[torch.Tensor] = []
        res_v: list[torch.Tensor] = []
        for layer, (k, v) in enumerate(zip(block.keys, block.values, strict=True)):
            for name, t in (("keys", k), ("values", v)):
                if t.dim() != 4 or t.shape[2] != n:
                    msg = (
                        f"block.{name}[{layer}]: expected [B, H, {n}, D] (n = len(offsets)), "
                        f"got {list(t.shape)}"
                    )
                    raise ValueError(msg)
            keys.append(quantize_keys(k[:, :, :q], bits, group_size))
            values.append(quantize_values(v[:, :, :q], bits, group_size))
            if r:
                # clone: a slice is a view that would keep the whole full-precision
                # source alive, and the tier's byte accounting would be a lie.
                res_k.append(k[:, :, q:].clone(memory_format=torch.contiguous_format))
                res_v.append(v[:, :, q:].clone(memory_format=torch.contiguous_format))
        return cls(
            keys=keys,
            values=values,
            offsets=list(block.offsets),
            residual_keys=res_k if r else None,
            residual_values=res_v if r else None,
        )

    @property
    def num_tokens(self) -> int:
        """Number of tokens held (quantized and residual)."""
        return len(self.offsets)

    @property
    def residual_tokens(self) -> int:
        """Number of trailing tokens kept in full precision."""
        return self.residual_keys[0].shape[2] if self.residual_keys else 0

    @cached_property
    def nbytes(self) -> int:
        """Exact bytes of every tensor held: codes, scales, zero points and residual (computed once)."""
        total = sum(qk.nbytes + qv.nbytes for qk, qv in zip(self.keys, self.values, strict=True))
        for residual in (self.residual_keys, self.residual_values):
            total += sum(tensor_bytes(t) for t in residual or ())
        return total

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> QuantizedBlock:
        """Move the quantized block (still quantized) to another device, e.g. to the host."""
        return QuantizedBlock(
            keys=[qk.to(device, non_blocking=non_blocking) for qk in self.keys],
            values=[qv.to(device, non_blocking=non_blocking) for qv in self.values],
            offsets=list(self.offsets),
            residual_keys=_move(self.residual_keys, device, non_blocking),
            residual_values=_move(self.residual_values, device, non_blocking),
        )

    def to_block(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> KVBlock:
        """Dequantize into a full-precision `KVBlock` with newly allocated tensors.

        The quantized data is moved to `device` first and dequantized there, so a
        host-to-device restore transfers the compact codes, not the expanded tensors.

        Args:
            device: Target device; defaults to where the quantized data is.
            dtype: Target dtype; defaults to each tensor's original dtype.

        Returns:
            The block, tokens in the order of `offsets`.
        """
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for layer, (qk, qv) in enumerate(zip(self.keys, self.values, strict=True)):
            if device is not None:
                qk, qv = qk.to(device), qv.to(device)
            k = qk.dequantize(dtype=dtype)  # k: [B, H, n - r, D]
            v = qv.dequantize(dtype=dtype)  # v: [B, H, n - r, D]
            if self.residual_keys is not None and self.residual_values is not None:
                rk = self.residual_keys[layer].to(device=k.device, dtype=k.dtype)  # rk: [B, H, r, D]
                rv = self.residual_values[layer].to(device=v.device, dtype=v.dtype)
                k, v = torch.cat([k, rk], dim=2), torch.cat([v, rv], dim=2)
            keys.append(k)
            values.append(v)
        return KVBlock(keys=keys, values=values, offsets=list(self.offsets))


def _quantize_groups(x: torch.Tensor, dim: int, bits: int, group_size: int) -> QuantizedTensor:
    """Asymmetric round-to-nearest quantization in groups of `group_size` along `dim`."""
    _check_bits(bits)
    _check_group_size(group_size)
    if not x.is_floating_point():
        msg = f"expected a floating point tensor, got dtype {x.dtype}"
        raise TypeError(msg)
    stat_dtype = torch.float16 if x.dtype in _HALF_DTYPES else torch.float32
    moved = x.movedim(dim, -1).float()  # [..., L], L = x.shape[dim]
    lead, length = moved.shape[:-1], moved.shape[-1]
    num_groups = -(-length // group_size)
    pad = num_groups * group_size - length
    if pad and length:
        # Repeat the last element: the padded group keeps its own min and max.
        moved = torch.cat([moved, moved[..., -1:].expand(*lead, pad)], dim=-1)
    grouped = moved.reshape(*lead, num_groups, group_size)  # [..., num_groups, G]
    try:
        codes, scales, zeros = quantize_along(grouped, bits, -1, stat_dtype=stat_dtype)
    except ValueError as e:
        msg = f"{e}; pass float32 input"
        raise ValueError(msg) from e
    codes = codes.reshape(*lead, num_groups * group_size)[..., :length]  # [..., L]
    if pad:
        # Own storage of exactly the real codes: the slice alone would keep the padding alive.
        codes = codes.clone(memory_format=torch.contiguous_format)
    return QuantizedTensor(
        data=_pack(codes, bits),
        scales=scales,
        zeros=zeros,
        bits=bits,
        group_size=group_size,
        dim=dim,
        shape=tuple(x.shape),
        dtype=x.dtype,
    )


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Flatten uint8 codes and pack them (`kivi.pack_codes`; int4: an odd count gets one padding code)."""
    flat = codes.reshape(-1)
    if bits == 8:
        return flat.contiguous()
    if flat.numel() % 2:
        flat = torch.nn.functional.pad(flat, (0, 1))
    return pack_codes(flat.reshape(-1, 2), bits).reshape(-1)


def _unpack(data: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of `_pack`: `numel` uint8 codes, 1-D."""
    if bits == 8:
        return data
    return unpack_codes(data.reshape(-1, 1), bits).reshape(-1)[:numel]


def _move(
    tensors: list[torch.Tensor] | None, device: torch.device | str, non_blocking: bool
) -> list[torch.Tensor] | None:
    return None if tensors is None else [t.to(device, non_blocking=non_blocking) for t in tensors]


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or bits not in ALLOWED_BITS:
        msg = f"bits must be one of {list(ALLOWED_BITS)}, got {bits!r}"
        raise ValueError(msg)


def _check_group_size(group_size: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        msg = f"group_size must be an int >= 1, got {group_size!r}"
        raise ValueError(msg)


def _check_4d(t: torch.Tensor, name: str) -> None:
    if t.dim() != 4:
        msg = f"{name}: expected shape [B, H, n, D], got {list(t.shape)}"
        raise ValueError(msg)


def quantized_block_bytes(
    shape: tuple[int, int, int],
    tokens: int,
    *,
    bits: int,
    group_size: int,
    residual_tokens: int,
    dtype: torch.dtype,
) -> int:
    """Bytes `QuantizedBlock.from_block` holds for `tokens` tokens of one layer of `shape` `(B, H, D)`.

    What its codes, statistics and full-precision residual take, counted without quantizing
    (the placement planner's cost of an int8 / int4 archive); `nbytes` of the block it builds.
    """
    b, h, d = shape
    r = min(residual_tokens, tokens)
    q = tokens - r
    stat = 2 if dtype in _HALF_DTYPES else 4
    codes = 2 * math.ceil(b * h * q * d * bits / 8) if q else 0
    key_stats = 2 * b * h * d * -(-q // group_size) * stat
    value_stats = 2 * b * h * q * -(-d // group_size) * stat
    residual = 2 * b * h * r * d * torch.empty(0, dtype=dtype).element_size()
    return codes + key_stats + value_stats + residual
