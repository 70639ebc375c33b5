"""8-bit keys held as two 4-bit planes: the low plane is a refinement the budget drops span by span.

Why keys get more bits than values: with a whole agent history held at int4 in
attention (sinks and the residual window exact, nothing evicted), SmolLM2-135M
loses about 0.25 nats of gold-answer log-probability per question against the
full cache; keys at 8 bits with values at 4 lose none, values at 8 with keys at 4
lose as much as int4 (`scripts/quant_probe.py`, docs/benchmarks.md). Keys carry the error,
as KIVI and KVQuant report. But 8-bit keys do not fit a tight budget, so they
are held so that they can become 4-bit keys without re-quantizing anything.

An 8-bit key code `c = 16 * hi + lo` (statistics `s`, `z` of the 8-bit grid):

- the *coarse plane* holds `hi` for every quantized slot; read alone it is a 4-bit
  code on the grid `z' + hi * s'` with `s' = 16 s` and `z' = z + 7.5 s` (the middle
  of the 16 fine codes it stands for): at most `8 s` (range / 31.9) from the key,
  against range / 30 for a round-to-nearest 4-bit code of the same group;
- the *fine plane* holds `lo` for some slots; with it the read is `z + c * s`, the
  8-bit key: `z' + hi * s' + (lo - 7.5) * s`.

Dropping a slot's fine plane is therefore a demotion with no new statistics and
no re-quantization: the coarse code and the group's scale and zero stay bit for
bit. Demotion order with planes: full precision -> keys at 8 bits -> keys at 4
bits -> archived -> evicted (`agentkv.lifecycle.budget`).
"""

from __future__ import annotations

import torch

from agentkv.store.kivi import pack_codes, unpack_codes

PLANE_KEY_BITS = 8
"""`attended_key_bits` value that holds keys in two planes."""

PLANE_BITS = 4
"""Bits of each plane."""


def floor_key_bits(key_bits: int) -> int:
    """Key bits at the floor of the attended tier: 8-bit keys drop to their coarse plane under pressure."""
    return PLANE_BITS if key_bits == PLANE_KEY_BITS else key_bits


FINE_MIDPOINT = 7.5
"""Where a coarse code reads within the 16 fine codes it stands for."""


def split_planes(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit codes `uint8 [..., D]` into (coarse, fine) planes, each packed at 4 bits `[..., D / 2]`."""
    return pack_codes(codes >> PLANE_BITS, PLANE_BITS), pack_codes(codes & 0xF, PLANE_BITS)


def coarse_stats(
    scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4-bit grid of the coarse plane, `(16 s, z + 7.5 s)` in `dtype`, from the 8-bit statistics."""
    s = scales.to(dtype)
    return s * (1 << PLANE_BITS), zeros.to(dtype) + FINE_MIDPOINT * s


def fine_correction(fine: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What the fine plane adds to coarse keys: `(lo - 7.5) * s`, `[B, H, F, D]`.

    `fine` `uint8 [B, H, F, D / 2]`; `scales` `[B, H, F, D]`: each row's 8-bit scale, in
    the output dtype.
    """
    lo = unpack_codes(fine, PLANE_BITS).to(scales.dtype)
    return lo.sub_(FINE_MIDPOINT).mul_(scales)


def add_fine(
    out: torch.Tensor, fine: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, groups: torch.Tensor
) -> None:
    """Refine coarse keys in `out` `[B, H, N, D]` at `slots` (`long [F]`, device) with their fine plane.

    `scales` `[B, H, Gk, D]`: the 8-bit scales in `out`'s dtype; `groups` (`long [F]`,
    device): the key group of each refined row.
    """
    if not int(slots.numel()):
        return
    out.index_add_(2, slots, fine_correction(fine, scales.index_select(2, groups)))


def fine_row_bytes(fine: torch.Tensor | None) -> int:
    """Bytes one slot's fine plane takes in a layer's `fine` `uint8 [B, H, F, D / 2]` (0 when none held)."""
    if fine is None or not int(fine.shape[2]):
        return 0
    return fine.element_size() * int(fine.shape[0] * fine.shape[1] * fine.shape[3])
