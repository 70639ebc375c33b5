"""Cache layers: one layer's keys and values, the first tokens possibly shared with other caches.

A forked cache (tree-of-thought branch) or a session started from the backend's
prefix cache attends tensors held elsewhere as a read-only prefix instead of
copying them; it only materialises its own copy when it must change that prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

__all__ = ["LayerFactory", "ManagedCache", "SharedPrefixLayer"]


class SharedPrefixLayer(DynamicLayer):
    """A dynamic cache layer whose first tokens may live in tensors shared with another cache.

    `keys` / `values` hold only this layer's *own* tokens; `prefix_keys` /
    `prefix_values` (possibly None) are the shared, never-mutated prefix.
    """

    def __init__(self) -> None:
        super().__init__()
        self.prefix_keys: torch.Tensor | None = None
        self.prefix_values: torch.Tensor | None = None

    @property
    def prefix_length(self) -> int:
        """Tokens held in the shared prefix."""
        return 0 if self.prefix_keys is None else int(self.prefix_keys.shape[-2])

    @property
    def own_length(self) -> int:
        """Tokens held in this layer's own tensors."""
        if not self.is_initialized or self.keys is None or self.keys.numel() == 0:
            return 0
        return int(self.keys.shape[-2])

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new states to the own tensors; return prefix + own for attention."""
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if self.prefix_keys is None or self.prefix_values is None:
            return keys, values
        return torch.cat([self.prefix_keys, keys], dim=-2), torch.cat([self.prefix_values, values], dim=-2)

    def get_seq_length(self) -> int:
        """Prefix plus own tokens: what the mask must cover."""
        return self.prefix_length + self.own_length

    def full(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """All keys and values (a new tensor when a prefix is shared); None when empty."""
        own_k = self.keys if self.own_length else None
        own_v = self.values if self.own_length else None
        if self.prefix_keys is None or self.prefix_values is None:
            return None if own_k is None or own_v is None else (own_k, own_v)
        if own_k is None or own_v is None:
            return self.prefix_keys, self.prefix_values
        return torch.cat([self.prefix_keys, own_k], dim=-2), torch.cat([self.prefix_values, own_v], dim=-2)

    def keys_at(self, slots: torch.Tensor) -> torch.Tensor | None:
        """Keys of some slots (`long [n]`, physical indices), `[B, H, n, D]`; None when empty.

        Reads only those slots: scoring a just-committed span must not copy (or, on a
        quantized layer, dequantize) the whole layer.
        """
        if not self.get_seq_length():
            return None
        prefix = self.prefix_keys
        if prefix is None:
            assert self.keys is not None
            return self.keys.index_select(-2, slots.to(self.keys.device))
        slots = slots.to(prefix.device)
        in_prefix = slots < self.prefix_length
        if bool(in_prefix.all()) or not self.own_length:
            return prefix.index_select(-2, slots)
        assert self.keys is not None
        out = prefix.new_empty((*prefix.shape[:-2], int(slots.numel()), prefix.shape[-1]))
        out[..., in_prefix, :] = prefix.index_select(-2, slots[in_prefix])
        out[..., ~in_prefix, :] = self.keys.index_select(-2, slots[~in_prefix] - self.prefix_length)
        return out

    def set_all(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Replace everything with own tensors (un-shares the prefix)."""
        self.prefix_keys = self.prefix_values = None
        self.keys, self.values = keys, values
        self.device = keys.device
        self.is_initialized = True

    def freeze_as_prefix(self) -> None:
        """Turn everything held into a read-only prefix that forks can share without copying."""
        full = self.full()
        if full is None:
            return
        self.prefix_keys, self.prefix_values = full
        self.keys = full[0][..., :0, :]
        self.values = full[1][..., :0, :]

    def attach_prefix(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Start empty over a read-only prefix held elsewhere (`[B, H, L, D]` each; not copied).

        The prefix is never written: every change that touches it materialises a copy
        (`select`, and the attended quantized tier's conversion).
        """
        if self.get_seq_length():
            msg = f"attach_prefix: the layer already holds {self.get_seq_length()} tokens, expected none"
            raise ValueError(msg)
        self.lazy_initialization(keys, values)
        self.prefix_keys, self.prefix_values = keys, values
        self.keys = keys[..., :0, :]
        self.values = values[..., :0, :]

    def copy_from(self, other: SharedPrefixLayer) -> None:
        """Hold a copy of everything another layer holds (own tensors, prefix materialised)."""
        full = other.full()
        if full is not None:
            self.set_all(full[0].clone(), full[1].clone())

    def cut_to(self, own: int) -> None:
        """Keep only the first `own` tokens of the own tensors (undo a partly applied append).

        The cut tensors are copies: a slice would keep the discarded tail's storage alive
        behind byte accounting that no longer counts it.
        """
        for name in ("keys", "values"):
            tensor = getattr(self, name, None)
            if isinstance(tensor, torch.Tensor) and tensor.dim() == 4 and tensor.shape[-2] > own:
                setattr(self, name, tensor[..., :own, :].clone())

    def select(self, keep: torch.Tensor) -> None:
        """Keep the slots `keep` (old slot indices, `long [n]`) in that order.

        A selection that keeps the shared prefix untouched and in place only touches
        the own tensors; any other one materialises a copy of everything.
        """
        full = self.full()
        if full is None:
            return
        prefix_len = self.prefix_length
        if (
            prefix_len
            and keep.numel() >= prefix_len
            and torch.equal(keep[:prefix_len], torch.arange(prefix_len))
        ):
            own_index = (keep[prefix_len:] - prefix_len).to(full[0].device)
            if self.keys is not None and self.values is not None:
                self.keys = self.keys.index_select(-2, own_index)
                self.values = self.values.index_select(-2, own_index)
            return
        index = keep.to(full[0].device)
        self.set_all(full[0].index_select(-2, index), full[1].index_select(-2, index))

    def quantize(self, slots: torch.Tensor) -> int:
        """Full-precision layers hold no quantized slots: nothing to do (0 quantized)."""
        del slots
        return 0

    @classmethod
    def quantize_all(
        cls, layers: Sequence[SharedPrefixLayer], slots: torch.Tensor | Sequence[torch.Tensor]
    ) -> int:
        """Quantize `slots` (one set, or one set per span) in every layer; slots quantized per layer.

        A layer class may batch the layers; this default quantizes each set in each layer.
        """
        sets = [slots] if isinstance(slots, torch.Tensor) else list(slots)
        return max((sum(layer.quantize(s) for s in sets) for layer in layers), default=0)

    def is_quantized(self, slots: torch.Tensor) -> torch.Tensor:
        """`bool [n]`: all False (every slot is full precision)."""
        return torch.zeros(int(slots.numel()), dtype=torch.bool)

    def own_tensors(self) -> Iterator[torch.Tensor]:
        """The tensors this layer owns (not the shared prefix)."""
        if self.own_length:
            assert self.keys is not None and self.values is not None
            yield self.keys
            yield self.values

    def prefix_tensors(self) -> Iterator[torch.Tensor]:
        """The shared prefix tensors, if any."""
        if self.prefix_keys is not None and self.prefix_values is not None:
            yield self.prefix_keys
            yield self.prefix_values


LayerFactory = Callable[[], SharedPrefixLayer]
"""Builds one cache layer: `SharedPrefixLayer` (full precision) or an attended quantized layer."""


class ManagedCache(Cache):
    """A transformers `Cache` made of `SharedPrefixLayer`s (full attention only)."""

    def __init__(self, num_layers: int, layer_factory: LayerFactory = SharedPrefixLayer) -> None:
        super().__init__(layers=[layer_factory() for _ in range(num_layers)])

    @property
    def managed_layers(self) -> list[SharedPrefixLayer]:
        """The layers, typed."""
        return [layer for layer in self.layers if isinstance(layer, SharedPrefixLayer)]
