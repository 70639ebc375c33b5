"""What each attended span costs on the device now and at each attended rung, counted from the codes.

The placement planner (`agentkv.lifecycle.placement`) chooses a rung per span on the
store's own byte counts, so a plan lands where it says. Every figure here is a sum
over layers of what the tensors hold (`agentkv.store.attended.QuantizedAttendedLayer`):

- a slot at full precision: its key and value rows in the model's dtype;
- a quantized slot: its coarse key codes, value codes and value statistics;
- a slot whose keys are held at 8 bits: its fine key plane on top (`key_planes`);
- a key group: one scale and one zero per channel, dropped with its last slot;
- on a model with sliding-window layers, the attended tier holds only the full layers:
  a slot the sliding layers still hold costs their key and value rows on top, at every
  attended rung (they are never quantized), and its archive holds them too.

Quantizing a span's `n` quantizable slots forms one set with `ceil(n / group_size)`
key groups, as `QuantizedAttendedLayer.quantize` does; dropping fine planes frees their
rows and nothing else. Removals not compacted yet (`PhysicalCache.deferred_removal`)
are counted as gone, with the key groups they empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agentkv.spans import Span
from agentkv.store.attended import QuantizedAttendedLayer
from agentkv.store.cache import PhysicalCache
from agentkv.store.key_planes import PLANE_BITS, PLANE_KEY_BITS
from agentkv.store.kivi import STAT_DTYPE, value_group
from agentkv.store.protocol import AttendedFloor, SpanCosts
from agentkv.store.quantized import quantized_block_bytes


@dataclass(frozen=True)
class SlotBytes:
    """Device bytes of one slot, fine row and key group, summed over the layers."""

    exact: int
    """A slot at full precision (key and value rows)."""
    quantized: int
    """A quantized slot: key codes at the floor's bits, value codes and statistics."""
    fine: int
    """A quantized slot's fine key plane (keys at 8 bits); 0 without 8-bit keys."""
    group: int
    """One key group's statistics."""
    group_size: int
    """Slots per key group."""
    layers: tuple[tuple[int, int, int], ...] = ()
    """Each layer's `(B, H, D)`: what an archive of the span holds is counted per layer."""
    dtype: torch.dtype = torch.float32
    """The model's dtype (full-precision slots, archive statistics)."""
    group_share: int = 0
    """A key group's statistics per slot of a full group, rounded up per layer (the amortized cost)."""
    window: int = 0
    """A slot the sliding layers hold: their key and value rows (0 without sliding layers)."""
    window_layers: tuple[tuple[int, int, int], ...] = ()
    """Each sliding layer's `(B, H, D)` (archives hold their held slots too)."""

    def floor(self, exact_tokens: int) -> AttendedFloor:
        """The attended tier's `AttendedFloor`: a token at the floor's bits, key statistics amortized."""
        token = self.quantized + self.group_share
        return AttendedFloor(
            token_bytes=token,
            exact_token_bytes=self.exact,
            span_bytes=self.quantized + self.group - token,
            exact_tokens=exact_tokens,
            fine_token_bytes=self.fine,
        )

    def quantized_set(self, n: int, *, fine: bool) -> int:
        """What `n` slots quantized as one set hold (their fine planes with them when `fine`)."""
        if n <= 0:
            return 0
        return n * (self.quantized + (self.fine if fine else 0)) + -(-n // self.group_size) * self.group


def slot_bytes(physical: PhysicalCache, *, bits: int, key_bits: int, group_size: int) -> SlotBytes | None:
    """The attended tier's byte figures for this cache (None before the first token)."""
    exact = quantized = fine = group = share = 0
    layers: list[tuple[int, int, int]] = []
    dtype = torch.float32
    stat = torch.empty(0, dtype=STAT_DTYPE).element_size()
    planes = key_bits == PLANE_KEY_BITS
    coarse_bits = PLANE_BITS if planes else key_bits
    for layer in physical.quantizable_layers:
        shape = _layer_shape(layer)
        if shape is None:
            return None
        b, h, d, element, dtype = shape
        layers.append((b, h, d))
        rows = b * h
        exact += 2 * rows * d * element
        value_stats = 2 * rows * (d // value_group(d, group_size)) * stat
        quantized += rows * d * (coarse_bits + bits) // 8 + value_stats
        fine += rows * d * PLANE_BITS // 8 if planes else 0
        group += 2 * rows * d * stat
        share += -(-2 * rows * d * stat // group_size)
    if not exact:
        return None
    window = 0
    window_layers: list[tuple[int, int, int]] = []
    layers_all = physical.cache.managed_layers
    for index in physical.sliding_layers:
        shape = _layer_shape(layers_all[index])
        if shape is None:
            continue  # nothing held yet (every slot out of its window)
        b, h, d, element, _ = shape
        window_layers.append((b, h, d))
        window += 2 * b * h * d * element
    return SlotBytes(
        exact, quantized, fine, group, group_size, tuple(layers), dtype, share, window, tuple(window_layers)
    )


@dataclass(frozen=True)
class ArchiveSpec:
    """How the store archives a span: the int8 / int4 tier's groups and residual, the host's bits."""

    group_size: int
    residual_tokens: int
    host_bits: int | None


def archive_bytes(unit: SlotBytes, tokens: int, bits: int, spec: ArchiveSpec, window_tokens: int = 0) -> int:
    """What a span archived at `bits` holds (`QuantizedBlock`s), over all layers.

    `tokens` slots of the full layers, `window_tokens` of the sliding layers (those they held).
    """
    return sum(
        quantized_block_bytes(
            shape,
            n,
            bits=bits,
            group_size=spec.group_size,
            residual_tokens=spec.residual_tokens,
            dtype=unit.dtype,
        )
        for shapes, n in ((unit.layers, tokens), (unit.window_layers, window_tokens))
        if n
        for shape in shapes
    )


@dataclass(frozen=True)
class SlotCounts:
    """Per live slot of the cache: its span, and whether it is quantized, fine, quantizable."""

    span: torch.Tensor
    """`long [n]` the span of each live slot."""
    quantized: torch.Tensor
    """`bool [n]` held quantized."""
    fine: torch.Tensor
    """`bool [n]` keys held at 8 bits (a subset of `quantized`)."""
    quantizable: torch.Tensor
    """`bool [n]` what the attended tier may quantize now."""
    group_span: torch.Tensor
    """`long [g]` the span of each live key group."""
    window: torch.Tensor | None = None
    """`bool [n]` held by the sliding layers too (None: no sliding layers)."""


def slot_counts(physical: PhysicalCache, quantizable: torch.Tensor) -> SlotCounts:
    """The live slots' state, from the first layer (layers hold the same slots quantized)."""
    live = physical.live_mask()
    all_slots = torch.arange(physical.length)
    layers = physical.quantizable_layers
    first = layers[0] if layers else None
    quantized = physical.quantized_mask(all_slots)
    if isinstance(first, QuantizedAttendedLayer) and first.quantized_length:
        fine = first.is_fine(all_slots) & quantized
        rows = live[first.quant_index]  # live quantized rows
        pairs = torch.stack([physical.slot_span[first.quant_index[rows]], first.key_group[rows]])
        group_span = torch.unique(pairs, dim=1)[0] if int(rows.sum()) else torch.empty(0, dtype=torch.long)
    else:
        fine = torch.zeros_like(quantized)
        group_span = torch.empty(0, dtype=torch.long)
    return SlotCounts(
        span=physical.slot_span[live],
        quantized=quantized[live],
        fine=fine[live],
        quantizable=quantizable[live],
        group_span=group_span,
        window=physical.slot_window[live] if physical.sliding_layers else None,
    )


def settled_bytes(counts: SlotCounts, unit: SlotBytes) -> int:
    """Device bytes of the live slots (what the cache holds once pending removals are compacted)."""
    quantized = int(counts.quantized.sum())
    exact = int(counts.span.numel()) - quantized
    fine = int(counts.fine.sum())
    groups = int(counts.group_span.numel())
    window = 0 if counts.window is None else int(counts.window.sum())
    return (
        exact * unit.exact
        + quantized * unit.quantized
        + fine * unit.fine
        + groups * unit.group
        + window * unit.window
    )


def span_costs(
    spans: Sequence[Span], counts: SlotCounts, unit: SlotBytes, *, planes: bool, archive: ArchiveSpec
) -> dict[int, SpanCosts]:
    """Each attended span's `SpanCosts` (see the module docstring for the arithmetic)."""
    ids = torch.tensor([s.span_id for s in spans], dtype=torch.long)
    out: dict[int, SpanCosts] = {}
    if not ids.numel():
        return out
    mine = counts.span.unsqueeze(0) == ids.unsqueeze(1)  # [spans, slots]
    held = mine.sum(1).tolist()
    quantized = (mine & counts.quantized).sum(1).tolist()
    fine = (mine & counts.fine).sum(1).tolist()
    more = (mine & counts.quantizable).sum(1).tolist()
    groups = (counts.group_span.unsqueeze(0) == ids.unsqueeze(1)).sum(1).tolist()
    windows = [0] * len(spans) if counts.window is None else (mine & counts.window).sum(1).tolist()
    for i, span in enumerate(spans):
        if not span.tier.attended:
            continue
        q, f, m, w = quantized[i], fine[i], more[i], windows[i]
        now = (held[i] - q) * unit.exact + q * unit.quantized + f * unit.fine + groups[i] * unit.group
        now += w * unit.window  # the sliding layers' rows: exact at every attended rung
        quantize_more = now - m * unit.exact + unit.quantized_set(m, fine=planes)
        coarse = quantize_more - (f + m) * unit.fine if planes else quantize_more
        n = held[i]
        host = n * unit.exact + w * unit.window
        if archive.host_bits is not None:
            host = min(host, archive_bytes(unit, n, archive.host_bits, archive, w))
        out[span.span_id] = SpanCosts(
            int8=archive_bytes(unit, n, 8, archive, w),
            int4=archive_bytes(unit, n, 4, archive, w),
            host=host,
            held=held[i],
            quantized=q,
            fine=f,
            quantizable=m,
            now=now,
            keys8=quantize_more if planes else None,
            coarse=coarse,
        )
    return out


def _layer_shape(layer: object) -> tuple[int, int, int, int, torch.dtype] | None:
    """(batch, kv heads, head dim, bytes of one element, dtype) of a layer's exact KV; None: empty."""
    for name in ("keys", "prefix_keys"):
        t = getattr(layer, name, None)
        if isinstance(t, torch.Tensor) and t.dim() == 4:
            b, h, _, d = t.shape
            return int(b), int(h), int(d), t.element_size(), t.dtype
    if isinstance(layer, QuantizedAttendedLayer) and layer.key_codes is not None:
        b, h, _, packed = layer.key_codes.shape
        dtype = layer.out_dtype or torch.float32
        element = torch.empty(0, dtype=dtype).element_size()
        return int(b), int(h), int(packed) * 8 // layer.key_code_bits, element, dtype
    return None
