"""The read path of the attended quantized tier: every slot of a layer written once into one output.

`QuantizedAttendedLayer.full()` reads a layer for its attention on every decode
step, so this is the tier's cost against a full-precision cache (which copies its
K/V once per append). One `[B, H, N, D]` output each for keys and values: exact
runs are copied into their slices, quantized runs are unpacked and dequantized
straight into theirs (`agentkv.store.kivi`'s `*_into`), with no per-run
concatenation and no intermediate `[B, H, Q, D]` codes or gathered statistics.
What is derived from the layout (which rows form which key blocks) is kept in a
`ReadPlan` until the layout changes; nothing dequantized is kept between reads.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from agentkv.store.key_planes import add_fine
from agentkv.store.kivi import KeyBlock, dequantize_keys_into, dequantize_values_into, key_blocks

Runs = list[tuple[bool, int, int]]
"""`QuantizedAttendedLayer._runs()`: (quantized, start in its segment, length), in physical order."""

MAX_DIRECT_RUNS = 4
"""Quantized runs dequantized straight into their slices; beyond, the segment at once, placed by index."""

_Stats = tuple[torch.Tensor, torch.Tensor]


class AttendedLayout(Protocol):
    """What a read needs of a `QuantizedAttendedLayer`: its fields (a protocol: no import cycle)."""

    keys: torch.Tensor | None
    values: torch.Tensor | None
    key_codes: torch.Tensor | None
    key_fine: torch.Tensor | None
    key_scales: torch.Tensor | None
    key_zeros: torch.Tensor | None
    value_codes: torch.Tensor | None
    value_scales: torch.Tensor | None
    value_zeros: torch.Tensor | None
    key_group: torch.Tensor
    quant_index: torch.Tensor
    exact_index: torch.Tensor
    out_dtype: torch.dtype | None
    bits: int
    key_bits: int

    @property
    def own_length(self) -> int:
        """Slots held."""

    @property
    def key_code_bits(self) -> int:
        """Bits of each code in `key_codes`."""

    def key_read_stats(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(scales, zeros) of the grid `key_codes` are read on."""

    @property
    def quantized_length(self) -> int:
        """Slots held quantized."""

    @property
    def exact_length(self) -> int:
        """Slots held in full precision."""


class ReadPlan(NamedTuple):
    """What a read derives from the layout, kept while the layout stands.

    `runs` is the `_runs()` list the plan was derived from: a decode append extends
    that list in place (exact slots only, the quantized runs unchanged), every other
    change of the layout replaces it, so the plan is valid while `runs` is the layer's.
    """

    runs: Runs
    direct: bool
    """Quantized runs dequantized in place (else the whole segment, then placed by index)."""
    blocks: list[list[KeyBlock] | None]
    """Key blocks of each quantized run read (`kivi.key_blocks`; None: gather per row)."""
    fine: tuple[torch.Tensor, torch.Tensor] | None = None
    """8-bit keys: the slots the fine plane refines and their key groups (`long [F]`, on the device)."""


def read_plan(
    runs: Runs, key_group: torch.Tensor, fine: tuple[torch.Tensor, torch.Tensor] | None = None
) -> ReadPlan:
    """The plan of a layer whose slots form `runs` and whose quantized rows are in key groups `key_group`.

    With more than `MAX_DIRECT_RUNS` quantized runs (many spans interleaved with exact
    ones) the segment is dequantized as one run and placed by index: a few kernels
    instead of a few per run.
    """
    quant_runs = [(a, n) for quant, a, n in runs if quant]
    direct = len(quant_runs) <= MAX_DIRECT_RUNS
    if not direct:
        quant_runs = [(0, int(key_group.numel()))]
    return ReadPlan(runs, direct, [key_blocks(key_group[a : a + n]) for a, n in quant_runs], fine)


def read_layer(layer: AttendedLayout, plan: ReadPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Every slot of `layer` in physical order, quantized ones dequantized: `[B, H, E + Q, D]` each."""
    assert layer.key_scales is not None and layer.key_zeros is not None
    assert layer.value_scales is not None and layer.value_zeros is not None
    dtype = layer.out_dtype or torch.float32
    b, h, _, d = layer.key_scales.shape
    shape = (b, h, layer.own_length, d)
    out_k = layer.key_scales.new_empty(shape, dtype=dtype)  # [B, H, N, D]
    out_v = layer.key_scales.new_empty(shape, dtype=dtype)
    stats = (
        layer.key_read_stats(dtype),  # [B, H, Gk, D]: the few group statistics
        (layer.value_scales.to(dtype), layer.value_zeros.to(dtype)),  # [B, H, Q, D/Gv]
    )
    if not plan.direct:
        q = layer.quantized_length
        quant_k, quant_v = out_k.new_empty((b, h, q, d)), out_v.new_empty((b, h, q, d))  # [B, H, Q, D]
        _dequantize_rows(layer, quant_k, quant_v, 0, plan.blocks[0], stats)
        index = layer.quant_index.to(out_k.device)
        out_k.index_copy_(2, index, quant_k)
        out_v.index_copy_(2, index, quant_v)
        if layer.exact_length:
            assert layer.keys is not None and layer.values is not None
            index = layer.exact_index.to(out_k.device)
            out_k.index_copy_(2, index, layer.keys)
            out_v.index_copy_(2, index, layer.values)
        _refine(layer, plan, out_k, dtype)
        return out_k, out_v
    at, blocks = 0, iter(plan.blocks)
    for quant, a, n in plan.runs:
        k, v = out_k.narrow(2, at, n), out_v.narrow(2, at, n)  # [B, H, n, D]
        if quant:
            _dequantize_rows(layer, k, v, a, next(blocks), stats)
        else:
            assert layer.keys is not None and layer.values is not None
            k.copy_(layer.keys.narrow(2, a, n))
            v.copy_(layer.values.narrow(2, a, n))
        at += n
    _refine(layer, plan, out_k, dtype)
    return out_k, out_v


def _refine(layer: AttendedLayout, plan: ReadPlan, out_k: torch.Tensor, dtype: torch.dtype) -> None:
    """Add the fine key plane (8-bit keys) to the coarse keys read into `out_k` (physical order)."""
    if plan.fine is None or layer.key_fine is None:
        return
    assert layer.key_scales is not None
    slots, groups = plan.fine
    add_fine(out_k, layer.key_fine, layer.key_scales.to(dtype), slots, groups)


def _dequantize_rows(
    layer: AttendedLayout,
    out_k: torch.Tensor,
    out_v: torch.Tensor,
    first: int,
    blocks: list[KeyBlock] | None,
    stats: tuple[_Stats, _Stats],
) -> None:
    """Quantized rows `first .. first + n` (n: `out_k`'s length) into `out_k`, `out_v` `[B, H, n, D]`.

    `narrow`, not `[:, :, a:b]`: a read is a few dozen small views, and indexing costs
    a few microseconds more each.
    """
    assert layer.key_codes is not None and layer.value_codes is not None
    n = int(out_k.shape[2])
    key_stats, (value_scales, value_zeros) = stats
    groups = layer.key_group.narrow(0, first, n)
    key_codes = layer.key_codes.narrow(2, first, n)  # [B, H, n, D / pk]
    dequantize_keys_into(out_k, key_codes, layer.key_code_bits, key_stats, blocks, groups)
    value_stats = (value_scales.narrow(2, first, n), value_zeros.narrow(2, first, n))  # [B, H, n, D/Gv]
    dequantize_values_into(out_v, layer.value_codes.narrow(2, first, n), layer.bits, value_stats)
