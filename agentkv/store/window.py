"""Sliding-window layers hold only the slots they can still attend.

A sliding layer with window w lets a query at position q attend a key at position p
only when `q - p < w`. Queries are never earlier than the session's next position
except when a span is recomputed at its old positions, so a sliding layer's KV for a
slot at p is dead once `next_position - p >= w`: it is dropped (`dead_slots`), and a
forward whose queries need a dropped slot gets it back first (`missing_slots`, then
`agentkv.backend.window_context`).

Every sliding layer of a model shares one window, so they share one index: the
bool `held` `[S]` over the physical slots (`PhysicalCache.slot_window`). A sliding
layer's tensors hold exactly the held slots, in physical order: slot i is at local
index `held[:i].sum()`. The full layers hold every slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agentkv.store.block import KVBlock, tensor_bytes
from agentkv.store.layer import SharedPrefixLayer

__all__ = [
    "LayerSlots",
    "WindowSpec",
    "dead_slots",
    "hold_slots",
    "keys_with_gaps",
    "local_index",
    "missing_slots",
    "select_local",
    "trim_slots",
]


@dataclass(frozen=True)
class WindowSpec:
    """Which layers slide, and by how many positions."""

    layers: tuple[int, ...]
    """Indices of the sliding layers (sorted)."""
    window: int
    """Positions a sliding layer attends, the query's own included (`q - p < window`)."""

    def __post_init__(self) -> None:
        if self.window <= 0:
            msg = f"sliding window: expected > 0 positions, got {self.window}"
            raise ValueError(msg)


def local_index(held: torch.Tensor) -> torch.Tensor:
    """`long [S]`: each slot's index in the sliding layers (meaningful where `held`)."""
    return torch.cumsum(held.to(torch.long), dim=0) - 1


def select_local(held: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The sliding layers' local indices to keep when the cache keeps global slots `keep` (in that order)."""
    kept = keep[held[keep]]
    return local_index(held)[kept]


def dead_slots(held: torch.Tensor, positions: torch.Tensor, window: int) -> torch.Tensor:
    """`bool [S]`: held slots no query after the newest slot can attend (`next - p >= window`).

    `next` is the newest slot's position + 1, the conversation's next position.
    """
    next_position = int(positions.max()) + 1 if positions.numel() else 0
    return held & (positions <= next_position - window)


def trim_slots(
    layers: Sequence[SharedPrefixLayer], held: torch.Tensor, positions: torch.Tensor, window: int
) -> torch.Tensor:
    """Drop the dead slots (`dead_slots`) from the sliding `layers`; the new `held` `[S]`."""
    alive = held & ~dead_slots(held, positions, window)
    local = local_index(held)[alive]
    for layer in layers:
        layer.select(local)
    return alive


def missing_slots(
    held: torch.Tensor,
    positions: torch.Tensor,
    queries: torch.Tensor,
    window: int,
    hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """`long [m]`: slots some query attends on a sliding layer that the sliding layers do not hold.

    `positions` `[S]` are the slots' logical positions, `queries` `[n]` the new tokens'.
    A slot at a query's own position (an old copy being recomputed) and `hidden` slots
    are never attended, so they are not missing.
    """
    if not queries.numel():
        return torch.empty(0, dtype=torch.long)
    ordered = torch.sort(queries.cpu()).values  # [n]
    # Queries strictly after p and less than `window` after it: (p, p + window - 1].
    after = torch.searchsorted(ordered, positions, right=True)  # [S]
    within = torch.searchsorted(ordered, positions + window - 1, right=True)  # [S]
    needed = (within > after) & ~held
    if hidden is not None and hidden.numel():
        needed[hidden.cpu()] = False
    return needed.nonzero().flatten()


def keys_with_gaps(layer: SharedPrefixLayer, held: torch.Tensor, slots: torch.Tensor) -> torch.Tensor | None:
    """A sliding layer's keys at global `slots`, `[B, H, n, D]`: zeros where it holds none (dead)."""
    mine = held[slots]
    some = layer.keys_at(local_index(held)[slots[mine]]) if bool(mine.any()) else None
    like = some if some is not None else (layer.keys if layer.keys is not None else layer.prefix_keys)
    if like is None:
        return None
    out = like.new_zeros((*like.shape[:-2], int(slots.numel()), like.shape[-1]))
    if some is not None:
        out[..., mine.to(out.device), :] = some
    return out


def hold_slots(
    layers: Sequence[SharedPrefixLayer],
    held: torch.Tensor,
    slots: torch.Tensor,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
) -> torch.Tensor:
    """The sliding `layers` hold `slots` too (not held now; per layer their KV `[B, H, n, D]` in that order).

    Each layer is rebuilt with every held slot in physical order. Returns the new `held` `[S]`.
    """
    now = held.clone()
    now[slots] = True
    old_local = local_index(held)
    new_slots = now.nonzero().flatten()  # [h]
    kept = held[new_slots]  # [h] bool: already in the layer
    given = torch.argsort(slots)[torch.cumsum((~kept).to(torch.long), dim=0) - 1][~kept]  # into `slots`
    for layer, k_new, v_new in zip(layers, keys, values, strict=True):
        full = layer.full()
        shape = (*k_new.shape[:-2], int(new_slots.numel()), k_new.shape[-1])
        out_k, out_v = k_new.new_empty(shape), v_new.new_empty(shape)
        old = kept.to(out_k.device)
        if full is not None and bool(kept.any()):
            index = old_local[new_slots[kept]].to(full[0].device)
            out_k[..., old, :] = full[0].index_select(-2, index).to(out_k.dtype)
            out_v[..., old, :] = full[1].index_select(-2, index).to(out_v.dtype)
        out_k[..., ~old, :] = k_new.index_select(-2, given.to(k_new.device))
        out_v[..., ~old, :] = v_new.index_select(-2, given.to(v_new.device))
        layer.set_all(out_k, out_v)
    return now


class LayerSlots:
    """Which physical slots each layer holds: a full layer every slot, a sliding layer those `held`.

    `held` (`bool [S]`, `PhysicalCache.slot_window`) is the cache's bookkeeping; the
    methods here read or return it and do what it means to the layers.
    """

    def __init__(self, num_layers: int, spec: WindowSpec | None) -> None:
        sliding = set(spec.layers) if spec is not None else set()
        self.window: int | None = spec.window if spec is not None else None
        """Positions a sliding layer attends (None: no sliding layer)."""
        self.sliding: tuple[int, ...] = tuple(sorted(sliding))
        self.full: tuple[int, ...] = tuple(i for i in range(num_layers) if i not in sliding)

    def index(self, layer: int, held: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Where layer `layer` holds `slots` (`long [n]`; for a sliding layer, slots it holds)."""
        return local_index(held)[slots] if layer in self.sliding else slots

    def select(self, layers: Sequence[SharedPrefixLayer], held: torch.Tensor, keep: torch.Tensor) -> None:
        """Every layer keeps the slots `keep` (old indices, in that order) it holds."""
        local = select_local(held, keep) if self.sliding else keep
        for i, layer in enumerate(layers):
            layer.select(local if i in self.sliding else keep)

    def trim(
        self, layers: Sequence[SharedPrefixLayer], held: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Drop the dead slots from the sliding layers; the new `held`."""
        if self.window is None or not bool(dead_slots(held, positions, self.window).any()):
            return held
        return trim_slots([layers[i] for i in self.sliding], held, positions, self.window)

    def hold(
        self,
        layers: Sequence[SharedPrefixLayer],
        held: torch.Tensor,
        slots: torch.Tensor,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """The sliding layers hold `slots` too (per sliding layer their KV); the new `held`."""
        return hold_slots([layers[i] for i in self.sliding], held, slots, keys, values)

    def keys_at(
        self, layers: Sequence[SharedPrefixLayer], layer: int, held: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor | None:
        """Keys of layer `layer` at `slots`, `[B, H, n, D]` (zeros where a sliding layer holds none)."""
        if layer in self.sliding:
            return keys_with_gaps(layers[layer], held, slots)
        return layers[layer].keys_at(slots)

    def extract(
        self, layers: Sequence[SharedPrefixLayer], slots: torch.Tensor, offsets: list[int]
    ) -> KVBlock:
        """A copy of the full layers' KV of `slots` (every layer without sliding ones)."""
        return _gather(layers, self.full, slots, offsets)

    def extract_window(
        self, layers: Sequence[SharedPrefixLayer], held: torch.Tensor, slots: torch.Tensor, offsets: list[int]
    ) -> KVBlock | None:
        """A copy of the sliding layers' KV of those of `slots` they hold (None: none held)."""
        mine = held[slots]
        if not self.sliding or not bool(mine.any()):
            return None
        kept = [o for o, m in zip(offsets, mine.tolist(), strict=True) if m]
        return _gather(layers, self.sliding, local_index(held)[slots[mine]], kept)

    def append(
        self,
        layers: Sequence[SharedPrefixLayer],
        blocks: Sequence[KVBlock],
        windows: Sequence[KVBlock | None],
    ) -> torch.Tensor:
        """Append blocks (full layers) and their sliding parts at the end; `held` `[n]` of the new slots."""
        for j, i in enumerate(self.full):
            layers[i].update(_cat([b.keys[j] for b in blocks]), _cat([b.values[j] for b in blocks]))
        present = [w for w in windows if w is not None]
        for j, i in enumerate(self.sliding if present else ()):
            layers[i].update(_cat([w.keys[j] for w in present]), _cat([w.values[j] for w in present]))
        if not self.sliding:
            return torch.ones(sum(b.num_tokens for b in blocks), dtype=torch.bool)
        return torch.tensor(
            [
                o in set(w.offsets) if w else False
                for b, w in zip(blocks, windows, strict=True)
                for o in b.offsets
            ],
            dtype=torch.bool,
        )

    def cut(self, layers: Sequence[SharedPrefixLayer], held: torch.Tensor, length: int) -> None:
        """Cut every layer's own tensors back to the first `length` slots (undo a partial append)."""
        kept = int(held[:length].sum())
        for i, layer in enumerate(layers):
            layer.cut_to(max(0, (kept if i in self.sliding else length) - layer.prefix_length))

    def problem(self, layers: Sequence[SharedPrefixLayer], length: int, held: torch.Tensor) -> str | None:
        """Why the layers do not hold what `length` slots and `held` say (None: they do)."""
        full = {layers[i].get_seq_length() for i in self.full}
        sliding = {layers[i].get_seq_length() for i in self.sliding}
        expected = int(held.sum())
        if not full - {length} and not sliding - {expected}:
            return None
        return (
            f"physical cache out of sync: bookkeeping has {length} slots ({expected} in the sliding "
            f"layers), full layers hold {sorted(full)}, sliding layers {sorted(sliding)}"
        )

    def slot_bytes(self, layers: Sequence[SharedPrefixLayer]) -> tuple[int, int]:
        """Bytes one slot costs in the full layers and in the sliding layers (0 where none is held)."""
        return (
            sum(_bytes_per_slot(layers[i]) for i in self.full),
            sum(_bytes_per_slot(layers[i]) for i in self.sliding),
        )

    def key_slots(self, held: torch.Tensor, new: int) -> dict[int, torch.Tensor]:
        """Per sliding layer, the slot of each key its kernel gets in a forward of `new` more tokens."""
        length = int(held.numel())
        keys = torch.cat([held.nonzero().flatten(), torch.arange(length, length + new)])  # [S_w + new]
        return dict.fromkeys(self.sliding, keys)


def _gather(
    layers: Sequence[SharedPrefixLayer], ids: Sequence[int], index: torch.Tensor, offsets: list[int]
) -> KVBlock:
    """A block of the layers `ids` at `index` (each layer's own slot indices)."""
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for i in ids:
        full = layers[i].full()
        if full is None:
            msg = "cannot extract from an empty cache"
            raise RuntimeError(msg)
        at = index.to(full[0].device)
        keys.append(full[0].index_select(-2, at))  # [B, H, n, D]
        values.append(full[1].index_select(-2, at))
    return KVBlock(keys=keys, values=values, offsets=offsets)


def _bytes_per_slot(layer: SharedPrefixLayer) -> int:
    """Bytes one slot costs in a full-precision layer (keys and values), 0 when it holds none."""
    held = layer.get_seq_length()
    if not held:
        return 0
    return sum(tensor_bytes(t) for t in (*layer.prefix_tensors(), *layer.own_tensors())) // held


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along the token dimension (no copy for a single tensor)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=-2)
