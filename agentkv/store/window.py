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
index `held[:i].sum()`. The full layers hold every slot as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from collections.abc import Sequence

import torch

from agentkv.store.layer import SharedPrefixLayer

__all__ = [
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
    """A sliding layer's keys at global `slots`, `[B, H, n, D]`: zeros where it holds none (never attended again)."""
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
