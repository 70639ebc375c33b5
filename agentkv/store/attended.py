"""The attended quantized tier: a cache layer that holds some tokens at int4/int2 and still attends them.

The archive tiers (`agentkv.store.quantized`, host, drop) take a span out of the
model's view; this layer keeps a span in view at a fraction of its bytes, with
KIVI's layout (Liu et al. 2024, https://arxiv.org/abs/2402.02750):

- keys are quantized **per channel** over groups of up to `group_size` tokens
  (key caches have outlier channels: a channel is large for every token, so its
  own scale keeps the other channels precise);
- values are quantized **per token** over groups of channels (attention mixes
  whole value rows, so the error of a row stays in that row).

Which tokens are quantized is not decided here. Every token arrives in full
precision (the *exact* segment); the budget (`agentkv.lifecycle.budget`) asks
the store to quantize whole spans, lowest lifecycle priority first, only when
the device budget requires it (demotion order: full precision -> attended
quantized -> archived -> evicted). With nothing quantized the layer returns its
exact tensors unchanged, so the logits are those of the full-precision cache.

Layout, N slots in physical order, each either exact or quantized:

- `keys`, `values` `[B, H, E, D]`: the exact slots, at `exact_index` (sorted);
- the quantized slots, at `quant_index` (sorted): packed codes, and statistics
  (scale and zero point, float16, zero rounded down and scale rounded up so the
  grid still covers each group's [min, max]);
- each quantized key belongs to a key group (`key_group[i]`); groups are formed
  when a span is quantized and are never re-formed: removing tokens (a demotion,
  commit-time compression, a rollback) drops their codes and keeps every other
  code and statistic bit for bit; a group that loses all its tokens is dropped.
  Nothing is ever re-quantized, so the error of a kept token never grows.

Attention reads the layer through `update()`, which dequantizes the quantized slots
(one layer at a time, a transient tensor freed after the layer's attention) and
places them with the exact ones, as transformers' `QuantizedCache` dequantizes on
read (`agentkv.store.attended_read` writes each slot once, into one output). The
last read is remembered (one layer per thread, `agentkv.store.attended_memo`): the attention probe
that reads the same layer right after its attention gets the same tensors instead
of a second dequantization. The slot indices are bookkeeping on the CPU, like
`PhysicalCache`'s.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from agentkv.store.attended_memo import HELD, LAST_READ
from agentkv.store.attended_read import ReadPlan, read_layer, read_plan
from agentkv.store.cache import SharedPrefixLayer
from agentkv.store.key_planes import PLANE_BITS, PLANE_KEY_BITS, add_fine, coarse_stats, split_planes
from agentkv.store.kivi import key_codes, token_bytes, unpack_codes, value_codes

ATTENDED_BITS: tuple[int, ...] = (4, 2)
"""Bit widths the attended quantized tier supports."""

ATTENDED_KEY_BITS: tuple[int, ...] = (PLANE_KEY_BITS, *ATTENDED_BITS)
"""Key bit widths: 8-bit keys are held in two 4-bit planes (`agentkv.store.key_planes`)."""

_LONG = torch.long


def check_attended_spec(
    bits: int, group_size: int, residual_tokens: int, head_dim: int | None = None, key_bits: int | None = None
) -> None:
    """Validate the attended tier's settings; raise `ValueError` naming expected, actual and allowed."""
    for name, value, allowed in (
        ("bits", bits, ATTENDED_BITS),
        ("key_bits", bits if key_bits is None else key_bits, ATTENDED_KEY_BITS),
    ):
        if isinstance(value, bool) or value not in allowed:
            msg = f"attended quantization {name}: expected one of {list(allowed)}, got {value!r}"
            raise ValueError(msg)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        msg = f"attended quantization group_size: expected an int >= 1, got {group_size!r}"
        raise ValueError(msg)
    if isinstance(residual_tokens, bool) or not isinstance(residual_tokens, int) or residual_tokens < 0:
        msg = f"attended quantization residual_tokens: expected an int >= 0, got {residual_tokens!r}"
        raise ValueError(msg)
    if head_dim is not None:
        for b in {bits, PLANE_BITS if key_bits == PLANE_KEY_BITS else (key_bits or bits)}:
            if head_dim % (8 // b):
                msg = (
                    f"attended quantization: head_dim must be a multiple of {8 // b} "
                    f"for {b}-bit codes, got {head_dim}"
                )
                raise ValueError(msg)


class QuantizedAttendedLayer(SharedPrefixLayer):
    """A cache layer whose slots are exact or quantized (KIVI layout), all attended.

    Shapes (B batch, H kv heads, E exact and Q quantized slots, Gk key groups, D head
    dim, pk / pv = 8 // bits codes per byte for keys / values, Gv channels per value group):

    - `keys`, `values`: exact slots, `[B, H, E, D]`; `exact_index`: `long [E]`, sorted;
    - `key_codes`: `uint8 [B, H, Q, D / pk]`; `key_scales`, `key_zeros`: `[B, H, Gk, D]`;
      `key_group`: `long [Q]`, the key group of each quantized slot;
    - with 8-bit keys (`planes`), `key_codes` is the coarse plane (pk = 2) and `key_fine`
      `uint8 [B, H, F, D / 2]` the fine plane of the slots `fine_index` (`long [F]`, sorted
      physical slots, a subset of `quant_index`; `agentkv.store.key_planes`);
    - `value_codes`: `uint8 [B, H, Q, D / pv]`; `value_scales`, `value_zeros`: `[B, H, Q, D / Gv]`;
    - `quant_index`: `long [Q]`, sorted: the physical slot of each quantized token.
    """

    def __init__(
        self, bits: int, group_size: int, residual_tokens: int = 0, key_bits: int | None = None
    ) -> None:
        check_attended_spec(bits, group_size, residual_tokens, key_bits=key_bits)
        super().__init__()
        self.bits = bits
        """Value bits."""
        self.key_bits = bits if key_bits is None else key_bits
        """Key bits (keys are the sensitive side, KIVI / KVQuant: int4 keys with int2 values is an option)."""
        self.group_size = group_size
        self.residual_tokens = residual_tokens
        """The store keeps this many most recent tokens exact (KIVI's residual window); kept for reference."""
        self.exact_index = torch.empty(0, dtype=_LONG)
        self.quant_index = torch.empty(0, dtype=_LONG)
        self.key_group = torch.empty(0, dtype=_LONG)
        self.key_codes: torch.Tensor | None = None
        self.key_fine: torch.Tensor | None = None
        self.fine_index = torch.empty(0, dtype=_LONG)
        self.key_scales: torch.Tensor | None = None
        self.key_zeros: torch.Tensor | None = None
        self.value_codes: torch.Tensor | None = None
        self.value_scales: torch.Tensor | None = None
        self.value_zeros: torch.Tensor | None = None
        self.out_dtype: torch.dtype | None = None
        self._layout: list[tuple[bool, int, int]] | None = None
        """Cached `_runs()`; None after any change of which slot is where."""
        self._plan: ReadPlan | None = None
        """What `full()` derives from the layout; valid while its `runs` is `_layout` (see `ReadPlan`)."""

    # -- sizes ---------------------------------------------------------------------------------

    @property
    def planes(self) -> bool:
        """Keys held at 8 bits in two 4-bit planes (the fine one can be dropped per slot)."""
        return self.key_bits == PLANE_KEY_BITS

    @property
    def key_code_bits(self) -> int:
        """Bits of each code in `key_codes` (the coarse plane's 4 with planes)."""
        return PLANE_BITS if self.planes else self.key_bits

    @property
    def fine_length(self) -> int:
        """Quantized slots whose keys are held at 8 bits (their fine plane is held)."""
        return int(self.fine_index.numel())

    def key_read_stats(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(scales, zeros) `[B, H, Gk, D]` in `dtype` of the grid `key_codes` are read on."""
        assert self.key_scales is not None and self.key_zeros is not None
        if self.planes:
            return coarse_stats(self.key_scales, self.key_zeros, dtype)
        return self.key_scales.to(dtype), self.key_zeros.to(dtype)

    def fine_targets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the fine plane goes: its slots and their key groups (`long [F]` each, on the device)."""
        rows = torch.searchsorted(self.quant_index, self.fine_index)
        device = self.key_codes.device if self.key_codes is not None else None
        return self.fine_index.to(device), self.key_group[rows].to(device)

    @property
    def quantized_length(self) -> int:
        """Slots held quantized."""
        return int(self.quant_index.numel())

    @property
    def exact_length(self) -> int:
        """Slots held in full precision."""
        return int(self.exact_index.numel())

    @property
    def own_length(self) -> int:
        """All slots held (this layer shares no prefix)."""
        return self.quantized_length + self.exact_length

    @property
    def prefix_length(self) -> int:
        """Always 0: a quantized layer never shares a prefix (a fork copies, see `copy_from`)."""
        return 0

    def get_seq_length(self) -> int:
        """Slots the mask must cover."""
        return self.own_length

    # -- reads and writes ------------------------------------------------------------------------

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new states as exact slots; return all slots, the quantized ones dequantized."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.out_dtype = key_states.dtype
        assert self.keys is not None and self.values is not None
        start, n = self.own_length, int(key_states.shape[-2])
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.exact_index = torch.cat([self.exact_index, torch.arange(start, start + n, dtype=_LONG)])
        if self._layout:
            quant, a, length = self._layout[-1]
            if quant:
                self._layout.append((False, self.exact_length - n, n))
            else:
                self._layout[-1] = (False, a, length + n)
        full = self.full()
        assert full is not None
        return full

    def full(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every slot in physical order, `[B, H, E + Q, D]` each; None when empty.

        One output tensor each for K and V, written once: exact runs copied in, quantized
        runs dequantized straight into their slices (`attended_read.read_layer`): no
        concatenation and, with a few quantized runs (the common layouts), no intermediate
        float tensor the size of the quantized segment.
        """
        if self.own_length == 0:
            return None
        if not self.quantized_length:
            assert self.keys is not None and self.values is not None
            return self.keys, self.values  # exact_index is 0..E-1: the tensors as they are
        remembered = LAST_READ.get(self)
        if remembered is not None:
            return remembered
        runs = self._runs()
        if self._plan is None or self._plan.runs is not runs:
            fine = self.fine_targets() if self.fine_length else None
            self._plan = read_plan(runs, self.key_group, fine)
        result = read_layer(self, self._plan)
        LAST_READ.put(self, result)
        return result

    def keys_at(self, slots: torch.Tensor) -> torch.Tensor | None:
        """Keys of some slots, `[B, H, n, D]`: exact ones copied, quantized ones dequantized alone."""
        if self.own_length == 0:
            return None
        assert self.keys is not None
        slots = slots.to("cpu", _LONG)
        if not self.quantized_length:
            return self.keys.index_select(-2, slots.to(self.keys.device))  # exact_index is 0..E-1
        assert self.key_codes is not None and self.key_scales is not None
        quant = torch.isin(slots, self.quant_index)
        b, h, _, d = self.key_scales.shape
        out = self.key_scales.new_empty((b, h, int(slots.numel()), d), dtype=self.out_dtype or torch.float32)
        exact_rows = torch.searchsorted(self.exact_index, slots[~quant]).to(self.keys.device)
        out[:, :, ~quant] = self.keys.index_select(-2, exact_rows)
        out[:, :, quant] = self._dequantize_keys(torch.searchsorted(self.quant_index, slots[quant]))
        return out

    def drop_fine(self, slots: torch.Tensor) -> int:
        """Hold the keys of `slots` (physical) at 4 bits: drop their fine plane. Returns rows dropped."""
        if not self.fine_length:
            return 0
        drop = torch.isin(self.fine_index, slots.to("cpu", _LONG))
        dropped = int(drop.sum())
        if dropped:
            assert self.key_fine is not None
            keep = (~drop).nonzero().flatten()
            self.fine_index = self.fine_index[keep]
            self.key_fine = self.key_fine.index_select(2, keep.to(self.key_fine.device))
            self._plan = None
        return dropped

    def is_fine(self, slots: torch.Tensor) -> torch.Tensor:
        """`bool [n]`: which of `slots` have their keys held at 8 bits."""
        return torch.isin(slots, self.fine_index)

    def _runs(self) -> list[tuple[bool, int, int]]:
        """Maximal runs of slots of one kind in physical order: (quantized, start in its segment, length)."""
        if self._layout is not None:
            return self._layout
        quant = torch.zeros(self.own_length, dtype=torch.bool)
        quant[self.quant_index] = True
        change = (quant[1:] != quant[:-1]).nonzero().flatten() + 1
        bounds = [0, *change.tolist(), self.own_length]
        runs: list[tuple[bool, int, int]] = []
        seen = {True: 0, False: 0}
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            kind = bool(quant[a])
            runs.append((kind, seen[kind], b - a))
            seen[kind] += b - a
        self._layout = runs
        return runs

    def set_all(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Replace everything with exact slots."""
        self.out_dtype = keys.dtype
        self.device = keys.device
        self.is_initialized = True
        self._clear_quantized()
        self.keys, self.values = keys, values
        self.exact_index = torch.arange(int(keys.shape[-2]), dtype=_LONG)
        self._layout = None

    def select(self, keep: torch.Tensor) -> None:
        """Keep the slots `keep` (`long [n]`, old slot indices) in that order, without re-quantizing.

        Each segment keeps its surviving slots (sorted by their new index); a key group
        that loses all its tokens is dropped, every other statistic is kept as it is.
        """
        new_of_old = torch.full((self.own_length,), -1, dtype=_LONG)
        self._layout = None
        new_of_old[keep] = torch.arange(int(keep.numel()), dtype=_LONG)
        e_take, self.exact_index = _surviving(new_of_old, self.exact_index)
        if self.keys is not None and self.values is not None and self.keys.dim() == 4:
            index = e_take.to(self.keys.device)
            self.keys = self.keys.index_select(-2, index)
            self.values = self.values.index_select(-2, index)
        if not self.quantized_length:
            return
        q_take, self.quant_index = _surviving(new_of_old, self.quant_index)
        if self.fine_length:
            assert self.key_fine is not None
            f_take, self.fine_index = _surviving(new_of_old, self.fine_index)
            self.key_fine = self.key_fine.index_select(2, f_take.to(self.key_fine.device))
        if not self.quantized_length:
            self._clear_quantized()
            return
        self._take_quantized(q_take)

    def quantize(self, slots: torch.Tensor) -> int:
        """Quantize the exact slots among `slots` (`long`, physical indices), in their order.

        Key groups are formed over runs of `group_size` of these slots (a span's tokens
        in order: neighbours share a group, KIVI); a last partial group gets its own
        statistics. Returns the number of slots quantized. `quantize_layers` does the
        same for many layers at once.
        """
        return quantize_layers([self], slots)

    @classmethod
    def quantize_all(
        cls, layers: Sequence[SharedPrefixLayer], slots: torch.Tensor | Sequence[torch.Tensor]
    ) -> int:
        """Quantize `slots` in every layer of a cache; batched (`quantize_layers`) when all are attended."""
        attended = [layer for layer in layers if isinstance(layer, QuantizedAttendedLayer)]
        if len(attended) != len(layers):
            return super().quantize_all(layers, slots)
        return quantize_layers(attended, slots)

    def _exact_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows of the exact segment (`long [n]`, physical order) holding the exact ones of `slots`."""
        slots = torch.unique(slots.to("cpu", _LONG))  # sorted: the slots' physical order
        pos = torch.searchsorted(self.exact_index, slots)
        inside = pos < self.exact_length
        pos, slots = pos[inside], slots[inside]
        return pos[self.exact_index[pos] == slots]

    def _hold_quantized(
        self,
        pos: torch.Tensor,
        keys: tuple[torch.Tensor, ...],
        values: tuple[torch.Tensor, ...],
        fine: torch.Tensor | None = None,
    ) -> None:
        """Move exact rows `pos` to the quantized segment: `keys` (codes, scales, zeros, group), `values`.

        `fine`: the rows' fine key plane (8-bit keys), in the order of `pos`.
        """
        assert self.keys is not None and self.values is not None
        kc, ks, kz, groups = keys
        vc, vs, vz = values
        self._layout = None
        new_index = self.exact_index[pos]
        keep = torch.ones(self.exact_length, dtype=torch.bool)
        keep[pos] = False
        rest = keep.nonzero().flatten().to(self.keys.device)
        self.keys, self.values = self.keys.index_select(-2, rest), self.values.index_select(-2, rest)
        self.exact_index = self.exact_index[keep]
        offset = 0 if self.key_scales is None else int(self.key_scales.shape[2])
        self.key_codes = _cat(self.key_codes, kc)
        self.key_scales = _cat(self.key_scales, ks)
        self.key_zeros = _cat(self.key_zeros, kz)
        self.value_codes = _cat(self.value_codes, vc)
        self.value_scales = _cat(self.value_scales, vs)
        self.value_zeros = _cat(self.value_zeros, vz)
        self.key_group = torch.cat([self.key_group, groups + offset])
        if fine is not None:
            self._hold_fine(new_index, fine)
        index = torch.cat([self.quant_index, new_index])
        order = torch.argsort(index)
        self.quant_index = index[order]
        if not torch.equal(order, torch.arange(int(order.numel()))):
            self._take_rows(order)

    def _hold_fine(self, slots: torch.Tensor, fine: torch.Tensor) -> None:
        """Add the fine key plane `fine` `[B, H, n, D / 2]` of `slots` (`long [n]`), kept in slot order."""
        index = torch.cat([self.fine_index, slots])
        planes = fine if self.key_fine is None else torch.cat([self.key_fine, fine], dim=2)
        order = torch.argsort(index)
        self.fine_index = index[order]
        self.key_fine = planes.index_select(2, order.to(planes.device))

    def is_quantized(self, slots: torch.Tensor) -> torch.Tensor:
        """`bool [n]`: which of `slots` are held quantized."""
        return torch.isin(slots, self.quant_index)

    def copy_from(self, other: SharedPrefixLayer) -> None:
        """Hold a copy of another layer's slots (a fork: quantized layers are not shared)."""
        if not isinstance(other, QuantizedAttendedLayer):
            super().copy_from(other)
            return
        self.is_initialized = other.is_initialized
        if other.is_initialized:
            self.device = other.device
        self.out_dtype = other.out_dtype
        for name in HELD:
            t = getattr(other, name, None)
            setattr(self, name, t.clone() if isinstance(t, torch.Tensor) else t)
        self.exact_index = other.exact_index.clone()
        self.quant_index = other.quant_index.clone()
        self.fine_index = other.fine_index.clone()
        self.key_group = other.key_group.clone()
        self._layout = None

    def freeze_as_prefix(self) -> None:
        """No-op: quantized layers are not shared (a fork copies them)."""

    def cut_to(self, length: int) -> None:
        """Keep only the first `length` slots (undo a partly applied append)."""
        if length < self.own_length:
            self.select(torch.arange(length, dtype=_LONG))

    def own_tensors(self) -> Iterator[torch.Tensor]:
        """Codes, statistics and the exact slots: every device tensor this layer holds."""
        for t in (
            self.key_codes,
            self.key_fine,
            self.key_scales,
            self.key_zeros,
            self.value_codes,
            self.value_scales,
            self.value_zeros,
        ):
            if t is not None:
                yield t
        if self.exact_length:
            assert self.keys is not None and self.values is not None
            yield self.keys
            yield self.values

    def prefix_tensors(self) -> Iterator[torch.Tensor]:
        """None: nothing is shared."""
        yield from ()

    # -- internals ---------------------------------------------------------------------------------

    def _clear_quantized(self) -> None:
        self.key_codes = self.key_scales = self.key_zeros = None
        self.value_codes = self.value_scales = self.value_zeros = None
        self.quant_index = torch.empty(0, dtype=_LONG)
        self.key_group = torch.empty(0, dtype=_LONG)
        self.key_fine = None
        self.fine_index = torch.empty(0, dtype=_LONG)

    def _take_rows(self, order: torch.Tensor) -> None:
        """Keep the quantized slots' rows at `order`, in that order (group statistics untouched)."""
        assert self.key_codes is not None and self.value_codes is not None
        assert self.value_scales is not None and self.value_zeros is not None
        dev = order.to(self.key_codes.device)
        self.key_codes = self.key_codes.index_select(2, dev)
        self.value_codes = self.value_codes.index_select(2, dev)
        self.value_scales = self.value_scales.index_select(2, dev)
        self.value_zeros = self.value_zeros.index_select(2, dev)
        self.key_group = self.key_group[order]

    def _take_quantized(self, take: torch.Tensor) -> None:
        """Keep the quantized slots at positions `take` (in that order); drop key groups left empty."""
        self._take_rows(take)  # the per-slot tensors: the same row selection
        assert self.key_scales is not None and self.key_zeros is not None
        used, self.key_group = torch.unique(self.key_group, sorted=True, return_inverse=True)
        if int(used.numel()) != int(self.key_scales.shape[2]):
            used_dev = used.to(self.key_scales.device)
            self.key_scales = self.key_scales.index_select(2, used_dev)
            self.key_zeros = self.key_zeros.index_select(2, used_dev)

    def _dequantize_keys(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Keys of the quantized slots (or of those at `rows`, `long [r]` into the quantized segment)."""
        assert self.key_codes is not None and self.key_scales is not None and self.key_zeros is not None
        dtype = self.out_dtype or torch.float32
        packed, group = self.key_codes, self.key_group
        if rows is None:
            rows = torch.arange(self.quantized_length, dtype=_LONG)
        packed, group = packed.index_select(2, rows.to(packed.device)), group[rows]
        codes = unpack_codes(packed, self.key_code_bits)  # [B, H, r, D]
        group = group.to(codes.device)
        scales, zeros = self.key_read_stats(dtype)  # [B, H, Gk, D]
        keys = torch.addcmul(zeros.index_select(2, group), codes.to(dtype), scales.index_select(2, group))
        if self.fine_length:
            assert self.key_fine is not None
            slots = self.quant_index[rows]
            refined = torch.isin(slots, self.fine_index)
            at = refined.nonzero().flatten()
            fine_rows = torch.searchsorted(self.fine_index, slots[refined])
            fine = self.key_fine.index_select(2, fine_rows.to(self.key_fine.device))
            add_fine(keys, fine, self.key_scales.to(dtype), at.to(keys.device), group[at.to(group.device)])
        return keys


LAYER_BATCH = 8
"""Layers quantized in one batch: fewer, larger kernels, with a transient copy of at most 8 layers' rows."""


def quantize_layers(
    layers: list[QuantizedAttendedLayer], slots: torch.Tensor | Sequence[torch.Tensor]
) -> int:
    """Quantize the exact slots among `slots` in every layer; returns slots quantized (per layer).

    `slots` is one set of slots, or several (one per span): each set forms its own key
    groups, exactly as if the sets were quantized one after another, but every layer is
    rewritten once. Layers of one cache hold the same slots in the same segments and
    share one spec, so their rows are quantized together, `LAYER_BATCH` layers per batch
    (the statistics are per layer all the same: they are computed along tokens or
    channels, never across the batch axis). Layers whose layout differs are quantized on
    their own.
    """
    sets = [slots] if isinstance(slots, torch.Tensor) else list(slots)
    first = layers[0] if layers else None
    if first is None or first.keys is None or first.values is None or not first.exact_length:
        return 0
    spec = (first.bits, first.key_bits, first.group_size)
    if any(
        (layer.bits, layer.key_bits, layer.group_size) != spec
        or not torch.equal(layer.exact_index, first.exact_index)
        for layer in layers[1:]
    ):
        return max(quantize_layers([layer], sets) for layer in layers)
    rows_per_set = [first._exact_rows(s) for s in sets]
    rows_per_set = [r for r in rows_per_set if r.numel()]
    if not rows_per_set:
        return 0
    pos = torch.cat(rows_per_set)
    batch = int(first.keys.shape[0])
    for start in range(0, len(layers), LAYER_BATCH):
        chunk = layers[start : start + LAYER_BATCH]
        key_parts: list[tuple[torch.Tensor, ...]] = []
        value_parts: list[tuple[torch.Tensor, ...]] = []
        fine_parts: list[torch.Tensor] = []
        offset = 0
        for rows in rows_per_set:
            dev = rows.to(first.keys.device)
            k = torch.cat([layer.keys.index_select(-2, dev) for layer in chunk if layer.keys is not None])
            v = torch.cat([layer.values.index_select(-2, dev) for layer in chunk if layer.values is not None])
            kc, ks, kz, groups = key_codes(k, first.key_bits, first.group_size)  # [len(chunk) * B, ...]
            if first.planes:
                kc, fine_part = split_planes(kc)  # 8-bit codes as coarse and fine 4-bit planes
                fine_parts.append(fine_part)
            key_parts.append((kc, ks, kz, groups + offset))
            value_parts.append(value_codes(v, first.bits, first.group_size))
            offset += int(ks.shape[2])
        kc, ks, kz = (torch.cat([p[i] for p in key_parts], dim=2) for i in range(3))
        groups = torch.cat([p[3] for p in key_parts])
        vc, vs, vz = (torch.cat([p[i] for p in value_parts], dim=2) for i in range(3))
        kf = torch.cat(fine_parts, dim=2) if fine_parts else None
        for i, layer in enumerate(chunk):
            b = slice(i * batch, (i + 1) * batch)
            fine = None if kf is None else kf[b]
            layer._hold_quantized(pos, (kc[b], ks[b], kz[b], groups), (vc[b], vs[b], vz[b]), fine)
    return int(pos.numel())


def quantized_bytes(layer: QuantizedAttendedLayer, n: int) -> tuple[int, int]:
    """(bytes n exact slots take now, bytes they take once quantized as one set), for one layer."""
    if layer.keys is None or n == 0:
        return 0, 0
    b, h, _, d = layer.keys.shape
    exact = 2 * n * b * h * d * layer.keys.element_size()
    return exact, token_bytes(
        b, h, d, bits=layer.bits, key_bits=layer.key_bits, group_size=layer.group_size, tokens=n
    )


def _surviving(new_of_old: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions within a segment of the slots that survive a selection, and their new slots (sorted)."""
    new = new_of_old[index]
    alive = (new >= 0).nonzero().flatten()
    order = torch.argsort(new[alive])
    take = alive[order]
    return take, new[take]


def _cat(held: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """Append along the token / group axis (dim 2)."""
    return new if held is None else torch.cat([held, new], dim=2)
