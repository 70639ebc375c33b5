r"""What Hadamard-rotated keys quantized per token would do in the lifecycle: `recall_bench.py`, keys swapped.

The attended int4 tier quantizes keys per channel over groups of tokens (KIVI). QuaRot
(Ashkboos et al. 2024, https://arxiv.org/abs/2404.00456) rotates keys by an orthonormal
Hadamard matrix `H` first, which spreads an outlier channel over every channel, and then
quantizes per token. `scripts/quant_probe.py` measured that layout (`k4v4-hk-tok`) with
everything quantized and nothing evicted: it loses a third of what KIVI keys lose. With
the same group size its statistics are as many as KIVI's (two per token per head for
64-channel heads in groups of 32), so its bytes are the same and no placement changes
for bytes' sake.

This script measures it without a second store layout: each quantized slot's key is
held, beside the KIVI codes the store keeps and counts, as the rotated per-token round
trip `dequant(quant_tok(k H)) Hᵀ` (float32, not counted: the real layout's bytes are the
counted ones), and every read of a quantized key returns that instead of the KIVI
dequantization. Values, placement and the byte accounting are the defaults'.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/rotated_bench.py \\
        --workloads ferry --full-tokens 2923 --budgets 0.25,0.125 --methods agentkv-nohost \\
        --out runs/rotated/ferry.json

Rows are written under the method's name with `+rot` appended (`recall_table.py --diff`).
"""

from __future__ import annotations

import math
import runpy
import sys
from pathlib import Path
from typing import Any

import torch
from dither_bench import rename_methods

import agentkv.store.attended_read as attended_read
from agentkv.store.attended import QuantizedAttendedLayer
from agentkv.store.kivi import round_trip_values

_HADAMARD: dict[int, torch.Tensor] = {}


def hadamard(d: int) -> torch.Tensor:
    """The orthonormal `d x d` Sylvester Hadamard matrix (`d` a power of two)."""
    if d not in _HADAMARD:
        h = torch.ones(1, 1)
        while h.shape[0] < d:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        _HADAMARD[d] = h / math.sqrt(d)
    return _HADAMARD[d]


def rotated_round_trip(k: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Keys `[B, H, n, D]` as they read back rotated, quantized per token, and rotated back."""
    h = hadamard(int(k.shape[-1])).to(k.device)
    return (round_trip_values(k.float() @ h, bits, group_size) @ h.T).to(k.dtype)


ORIGINAL = {
    "hold": QuantizedAttendedLayer._hold_quantized,
    "take": QuantizedAttendedLayer._take_rows,
    "clear": QuantizedAttendedLayer._clear_quantized,
    "copy": QuantizedAttendedLayer.copy_from,
    "rows": attended_read._dequantize_rows,
}


def hold_quantized(self: Any, pos: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    """Keep the rotated round trip of the rows about to be quantized, in the quantized segment's order."""
    assert self.keys is not None
    rows = self.keys.index_select(-2, pos.to(self.keys.device))  # [B, H, n, D]
    tilde = rotated_round_trip(rows, self.key_bits, self.group_size)
    held = getattr(self, "key_tilde", None)
    self.key_tilde = tilde if held is None else torch.cat([held, tilde], dim=2)
    ORIGINAL["hold"](self, pos, *args, **kwargs)


def take_rows(self: Any, order: torch.Tensor) -> None:
    """The store's row selection, applied to the rotated keys too."""
    ORIGINAL["take"](self, order)
    self.key_tilde = self.key_tilde.index_select(2, order.to(self.key_tilde.device))


def clear_quantized(self: Any) -> None:
    """Nothing quantized: no rotated keys either."""
    ORIGINAL["clear"](self)
    self.key_tilde = None


def copy_from(self: Any, other: Any) -> None:
    """A fork copies the rotated keys with the codes."""
    ORIGINAL["copy"](self, other)
    tilde = getattr(other, "key_tilde", None)
    self.key_tilde = None if tilde is None else tilde.clone()


def dequantize_rows(layer: Any, out_k: torch.Tensor, out_v: torch.Tensor, first: int, *args: Any) -> None:
    """The store's read of quantized rows, with the keys replaced by their rotated round trip."""
    ORIGINAL["rows"](layer, out_k, out_v, first, *args)
    out_k.copy_(layer.key_tilde.narrow(2, first, int(out_k.shape[2])))


def dequantize_keys(self: Any, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Keys of the quantized slots (or of `rows`): the rotated round trip."""
    tilde = self.key_tilde
    return tilde if rows is None else tilde.index_select(2, rows.to(tilde.device))


if __name__ == "__main__":
    QuantizedAttendedLayer._hold_quantized = hold_quantized  # type: ignore[method-assign]
    QuantizedAttendedLayer._take_rows = take_rows  # type: ignore[method-assign]
    QuantizedAttendedLayer._clear_quantized = clear_quantized  # type: ignore[method-assign]
    QuantizedAttendedLayer.copy_from = copy_from  # type: ignore[method-assign]
    QuantizedAttendedLayer._dequantize_keys = dequantize_keys  # type: ignore[method-assign]
    attended_read._dequantize_rows = dequantize_rows
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    sys.argv = ["recall_bench.py", *sys.argv[1:]]
    runpy.run_path(str(Path(__file__).with_name("recall_bench.py")), run_name="__main__")
    rename_methods(out, "+rot")
