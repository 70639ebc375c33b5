r"""The noise floor of a quantized cache's exact match: `recall_bench.py` with a seeded dither.

Every KIVI code is rounded from `x / step + 0.1 * N(0, 1)` instead of `x / step`: about
8% of codes move by one step and the rounding error's variance grows by about 12%
(`0.01` of a step squared on top of `1/12`). Each seed is an int4 cache about as faithful
as the default one, so the answers a seed changes against the defaults (or against
another seed) are changed by nothing a placement plan decides: that spread is how far
a set's exact match moves by chance, the yardstick for a lever's gain or a goal's gap.

    AGENTKV_DITHER_SEED=1 OMP_NUM_THREADS=1 .venv/bin/python scripts/dither_bench.py \\
        --workloads ferry --full-tokens 2923 --budgets 0.25,0.125 --methods agentkv-nohost \\
        --out runs/dither1/ferry.json

The rows are written under the method's name with `+dither<seed>` appended, so
`scripts/recall_table.py --diff agentkv-nohost+dither1 agentkv-nohost runs/dither1/W.json runs/W.json`
pairs them with the defaults' rows question by question.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

import torch

import agentkv.store.kivi as kivi
import agentkv.store.quantized as quantized

DITHER = 0.1
"""Standard deviation of the dither, in quantization steps."""


def dithered_quantize_along(
    x: torch.Tensor, bits: int, dim: int, *, stat_dtype: torch.dtype = kivi.STAT_DTYPE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`kivi.quantize_along`'s statistics, its codes rounded after `DITHER` steps of seeded noise."""
    _, scales, zeros = ROUND_TO_NEAREST(x, bits, dim, stat_dtype=stat_dtype)
    s, z = scales.float().unsqueeze(dim), zeros.float().unsqueeze(dim)
    noise = DITHER * torch.randn(x.shape, generator=GENERATOR).to(x.device)
    codes = ((x.float() - z) / torch.where(s > 0, s, 1.0) + noise).round_().clamp_(0, (1 << bits) - 1)
    return codes.to(torch.uint8), scales, zeros


ROUND_TO_NEAREST = kivi.quantize_along
"""The tier's own quantizer: its statistics (and its checks) are kept."""
SEED = int(os.environ.get("AGENTKV_DITHER_SEED", "1"))
GENERATOR = torch.Generator().manual_seed(SEED)


def rename_methods(path: Path, suffix: str) -> None:
    """Append `suffix` to the method of every row in a `recall_bench.py` output."""
    rows = json.loads(path.read_text())
    for row in rows:
        row["method"] = f"{row['method']}{suffix}"
    path.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    kivi.quantize_along = dithered_quantize_along
    quantized.quantize_along = dithered_quantize_along
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    sys.argv = ["recall_bench.py", *sys.argv[1:]]
    runpy.run_path(str(Path(__file__).with_name("recall_bench.py")), run_name="__main__")
    rename_methods(out, f"+dither{SEED}")
