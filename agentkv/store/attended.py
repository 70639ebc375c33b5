"""The attended quantized tier: a cache layer that keeps its history at int4/int2 and still attends it.

The archive tiers (`agentkv.store.quantized`, host, drop) take a span out of the
model's view; this layer keeps every token in view at a fraction of the bytes,
as KIVI does (Liu et al. 2024, https://arxiv.org/abs/2402.02750):

- keys are quantized **per channel** over groups of `group_size` consecutive
  tokens (key caches have outlier channels: a channel is large for every token,
  so its own scale keeps the other channels precise);
- values are quantized **per token** over groups of channels (attention mixes
  whole value rows, so the error of a row stays in that row);
- the most recent `residual_tokens` tokens (at least) stay in full precision: the
  tokens a new token attends most sharply, and the ones whose key group is not
  complete yet. Once `residual_tokens + group_size` tokens are in the window, the
  oldest `group_size` are quantized (streaming, as in KIVI's decode).

Attention reads the layer through `update()`, which returns the history
dequantized (one layer at a time, a transient tensor freed after the layer's
attention) followed by the residual window: "dequantize on read per layer", as
transformers' `QuantizedCache` does. Only codes, statistics and the residual
window are held.

Statistics (scale and zero point per group) are stored in float16 with the zero
rounded down and the scale rounded up, so the grid still covers each group's
[min, max] and the error stays within half a step, as in `agentkv.store.quantized`.

Everything the physical cache does to a layer goes through `full()` and
`set_all()`; for this layer `set_all` re-quantizes what it is given. A compaction
that removes tokens (a demotion, commit-time compression) therefore re-quantizes
the layer's history: values (per-token groups) come back on their own grid, keys
of a token group that lost members get a new, never wider, grid, so the error
stays within half a step of the new grid plus the error already there.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from agentkv.store.cache import SharedPrefixLayer

ATTENDED_BITS: tuple[int, ...] = (4, 2)
"""Bit widths the attended quantized tier supports."""

_STAT_DTYPE = torch.float16


def check_attended_spec(
    bits: int, group_size: int, residual_tokens: int, head_dim: int | None = None
) -> None:
    """Validate the attended tier's settings; raise `ValueError` naming expected, actual and allowed."""
    if isinstance(bits, bool) or bits not in ATTENDED_BITS:
        msg = f"attended quantization bits: expected one of {list(ATTENDED_BITS)}, got {bits!r}"
        raise ValueError(msg)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        msg = f"attended quantization group_size: expected an int >= 1, got {group_size!r}"
        raise ValueError(msg)
    if isinstance(residual_tokens, bool) or not isinstance(residual_tokens, int) or residual_tokens < 0:
        msg = f"attended quantization residual_tokens: expected an int >= 0, got {residual_tokens!r}"
        raise ValueError(msg)
    if head_dim is not None and head_dim % (8 // bits):
        msg = (
            f"attended quantization: head_dim must be a multiple of {8 // bits} "
            f"for {bits}-bit codes, got {head_dim}"
        )
        raise ValueError(msg)


class QuantizedAttendedLayer(SharedPrefixLayer):
    """A cache layer whose history is held at `bits` (KIVI layout) and attended dequantized.

    Layout of what is held (B batch, H kv heads, Q quantized tokens, a multiple of
    `group_size`, r residual tokens, D head dim, p = 8 // bits codes per byte):

    - `key_codes`, `value_codes`: `uint8 [B, H, Q, D / p]`, codes packed along the channels;
    - `key_scales`, `key_zeros`: `[B, H, Q / group_size, D]` (per channel, per token group);
    - `value_scales`, `value_zeros`: `[B, H, Q, D / value_group]` (per token, per channel group);
    - `keys`, `values`: the residual window, full precision, `[B, H, r, D]`.
    """

    def __init__(self, bits: int, group_size: int, residual_tokens: int) -> None:
        check_attended_spec(bits, group_size, residual_tokens)
        super().__init__()
        self.bits = bits
        self.group_size = group_size
        self.residual_tokens = residual_tokens
        self.key_codes: torch.Tensor | None = None
        self.key_scales: torch.Tensor | None = None
        self.key_zeros: torch.Tensor | None = None
        self.value_codes: torch.Tensor | None = None
        self.value_scales: torch.Tensor | None = None
        self.value_zeros: torch.Tensor | None = None
        self.out_dtype: torch.dtype | None = None

    # -- sizes ---------------------------------------------------------------------------------

    @property
    def quantized_length(self) -> int:
        """Tokens held quantized."""
        return 0 if self.key_codes is None else int(self.key_codes.shape[-2])

    @property
    def residual_length(self) -> int:
        """Tokens held in the full-precision window."""
        if not self.is_initialized or self.keys is None or self.keys.numel() == 0:
            return 0
        return int(self.keys.shape[-2])

    @property
    def own_length(self) -> int:
        """All tokens held (this layer shares no prefix)."""
        return self.quantized_length + self.residual_length

    @property
    def prefix_length(self) -> int:
        """Always 0: a quantized layer never shares a prefix (a fork copies, see `PhysicalCache.fork`)."""
        return 0

    def get_seq_length(self) -> int:
        """Tokens the mask must cover."""
        return self.own_length

    # -- reads and writes ------------------------------------------------------------------------

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new states to the residual window, quantize what left it; return all, dequantized."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.out_dtype = key_states.dtype
        assert self.keys is not None and self.values is not None
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self._flush()
        full = self.full()
        assert full is not None
        return full

    def full(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """History dequantized, then the residual window: `[B, H, Q + r, D]` each; None when empty."""
        if self.own_length == 0:
            return None
        residual_k = self.keys if self.residual_length else None
        residual_v = self.values if self.residual_length else None
        if not self.quantized_length:
            assert residual_k is not None and residual_v is not None
            return residual_k, residual_v
        k = self._dequantize_keys()  # [B, H, Q, D]
        v = self._dequantize_values()  # [B, H, Q, D]
        if residual_k is None or residual_v is None:
            return k, v
        return torch.cat([k, residual_k], dim=-2), torch.cat([v, residual_v], dim=-2)

    def set_all(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Replace everything: keep the last tokens in the window, quantize the rest."""
        self.out_dtype = keys.dtype
        self.device = keys.device
        self.is_initialized = True
        self.key_codes = self.key_scales = self.key_zeros = None
        self.value_codes = self.value_scales = self.value_zeros = None
        self.keys, self.values = keys, values
        self._flush()
        # Own the window's storage: it may be a view of a larger tensor the caller frees.
        self.keys = self.keys.clone(memory_format=torch.contiguous_format)
        self.values = self.values.clone(memory_format=torch.contiguous_format)

    def freeze_as_prefix(self) -> None:
        """No-op: quantized layers are not shared (a fork copies them)."""

    def cut_to(self, length: int) -> None:
        """Keep only the first `length` tokens (undo a partly applied append)."""
        if length >= self.own_length:
            return
        full = self.full()
        assert full is not None
        self.set_all(full[0][..., :length, :].clone(), full[1][..., :length, :].clone())

    def own_tensors(self) -> Iterator[torch.Tensor]:
        """Codes, statistics and the residual window: everything this layer holds."""
        for t in (
            self.key_codes,
            self.key_scales,
            self.key_zeros,
            self.value_codes,
            self.value_scales,
            self.value_zeros,
        ):
            if t is not None:
                yield t
        if self.residual_length:
            assert self.keys is not None and self.values is not None
            yield self.keys
            yield self.values

    def prefix_tensors(self) -> Iterator[torch.Tensor]:
        """None: nothing is shared."""
        yield from ()

    # -- quantization ------------------------------------------------------------------------------

    def _flush(self) -> None:
        """Quantize the oldest whole key groups once the window is over `residual_tokens + group_size`."""
        assert self.keys is not None and self.values is not None
        r = int(self.keys.shape[-2])
        over = r - self.residual_tokens
        n = (over // self.group_size) * self.group_size if over >= self.group_size else 0
        if n <= 0:
            return
        k_old, v_old = self.keys[..., :n, :], self.values[..., :n, :]
        kc, ks, kz = _quantize_keys(k_old, self.bits, self.group_size)
        vc, vs, vz = _quantize_values(v_old, self.bits, self.group_size)
        self.key_codes = _cat(self.key_codes, kc)
        self.key_scales = _cat(self.key_scales, ks)
        self.key_zeros = _cat(self.key_zeros, kz)
        self.value_codes = _cat(self.value_codes, vc)
        self.value_scales = _cat(self.value_scales, vs)
        self.value_zeros = _cat(self.value_zeros, vz)
        self.keys = self.keys[..., n:, :].clone(memory_format=torch.contiguous_format)
        self.values = self.values[..., n:, :].clone(memory_format=torch.contiguous_format)

    def _dequantize_keys(self) -> torch.Tensor:
        assert self.key_codes is not None and self.key_scales is not None and self.key_zeros is not None
        codes = _unpack(self.key_codes, self.bits)  # [B, H, Q, D]
        b, h, q, d = codes.shape
        grouped = codes.view(b, h, q // self.group_size, self.group_size, d)  # [B, H, Q/G, G, D]
        dtype = self.out_dtype or torch.float32
        scales = self.key_scales.to(dtype).unsqueeze(-2)  # [B, H, Q/G, 1, D]
        zeros = self.key_zeros.to(dtype).unsqueeze(-2)
        return torch.addcmul(zeros, grouped.to(dtype), scales).view(b, h, q, d)

    def _dequantize_values(self) -> torch.Tensor:
        assert self.value_codes is not None and self.value_scales is not None and self.value_zeros is not None
        codes = _unpack(self.value_codes, self.bits)  # [B, H, Q, D]
        b, h, q, d = codes.shape
        groups = int(self.value_scales.shape[-1])
        grouped = codes.view(b, h, q, groups, d // groups)  # [B, H, Q, D/Gv, Gv]
        dtype = self.out_dtype or torch.float32
        scales = self.value_scales.to(dtype).unsqueeze(-1)  # [B, H, Q, D/Gv, 1]
        zeros = self.value_zeros.to(dtype).unsqueeze(-1)
        return torch.addcmul(zeros, grouped.to(dtype), scales).view(b, h, q, d)


def value_group(head_dim: int, group_size: int) -> int:
    """Channels per value group: `group_size`, capped at the head dim, dividing it."""
    g = min(group_size, head_dim)
    while head_dim % g:
        g -= 1
    return g


def _quantize_keys(k: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, ...]:
    """Per-channel key quantization of `[B, H, n, D]`, n a multiple of `group_size`."""
    b, h, n, d = k.shape
    grouped = k.float().reshape(b, h, n // group_size, group_size, d)  # [B, H, n/G, G, D]
    codes, scales, zeros = _quantize(grouped, bits, dim=-2)
    return _pack(codes.reshape(b, h, n, d), bits), scales, zeros


def _quantize_values(v: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, ...]:
    """Per-token value quantization of `[B, H, n, D]` in groups of channels."""
    b, h, n, d = v.shape
    g = value_group(d, group_size)
    grouped = v.float().reshape(b, h, n, d // g, g)  # [B, H, n, D/Gv, Gv]
    codes, scales, zeros = _quantize(grouped, bits, dim=-1)
    return _pack(codes.reshape(b, h, n, d), bits), scales, zeros


def _quantize(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest along `dim`; statistics squeezed out of `dim`, float16."""
    qmax = (1 << bits) - 1
    lo, hi = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    zeros = _round_toward(lo, up=False)
    scales = _round_toward((hi - zeros.float()) / qmax, up=True)
    if not (bool(torch.isfinite(zeros).all()) and bool(torch.isfinite(scales).all())):
        msg = "cannot quantize: non-finite KV values or values beyond the float16 range of the statistics"
        raise ValueError(msg)
    s, z = scales.float(), zeros.float()
    codes = ((x - z) / torch.where(s > 0, s, 1.0)).round_().clamp_(0, qmax).to(torch.uint8)
    return codes, scales.squeeze(dim), zeros.squeeze(dim)


def _round_toward(x: torch.Tensor, *, up: bool) -> torch.Tensor:
    """float32 → float16, rounding up or down instead of to nearest (the grid keeps covering the group)."""
    y = x.to(_STAT_DTYPE)
    target = torch.full_like(y, float("inf") if up else float("-inf"))
    wrong_side = y.float() < x if up else y.float() > x
    return torch.where(wrong_side, torch.nextafter(y, target), y)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack `uint8 [..., D]` codes of `bits` each into `[..., D * bits / 8]` bytes (lowest bits first)."""
    per = 8 // bits
    out = codes[..., 0::per].clone()
    for i in range(1, per):
        out |= codes[..., i::per] << (bits * i)
    return out


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `_pack`: `uint8 [..., D]`."""
    per = 8 // bits
    mask = (1 << bits) - 1
    parts = [(packed >> (bits * i)) & mask for i in range(per)]
    return torch.stack(parts, dim=-1).flatten(-2)  # [..., D / per, per] -> [..., D]


def _cat(held: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """Append along the token axis (dim 2)."""
    return new if held is None else torch.cat([held, new], dim=2)
