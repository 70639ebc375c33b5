"""KV blocks: a span's keys and values lifted out of the physical cache.

A block is what moves between tiers. It holds, for every layer, the keys and
values of some tokens of one span, plus the span offsets they belong to, so that
restoring it can put the same tokens back (at the end of the physical cache; the
keys keep the RoPE rotation of their logical positions).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes held by a tensor's elements (what accounting reports per tier)."""
    return tensor.numel() * tensor.element_size()


def kv_bytes(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> int:
    """Bytes of per-layer key and value tensors (one of each per layer)."""
    return sum(tensor_bytes(k) + tensor_bytes(v) for k, v in zip(keys, values, strict=True))


@dataclass
class KVBlock:
    """Full-precision KV of some tokens of one span, on any device."""

    keys: list[torch.Tensor]
    """Per layer, `[B, H_kv, n, D]`."""
    values: list[torch.Tensor]
    """Per layer, `[B, H_kv, n, D]`."""
    offsets: list[int]
    """Offsets within the span of the n tokens, in the order they are stored."""

    @property
    def num_tokens(self) -> int:
        """Number of tokens held."""
        return len(self.offsets)

    @property
    def nbytes(self) -> int:
        """Exact bytes of every tensor held."""
        return kv_bytes(self.keys, self.values)

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> KVBlock:
        """Copy to another device (a no-op view when already there)."""
        return KVBlock(
            keys=[k.to(device, non_blocking=non_blocking) for k in self.keys],
            values=[v.to(device, non_blocking=non_blocking) for v in self.values],
            offsets=list(self.offsets),
        )
