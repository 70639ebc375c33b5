"""Cost of one compaction of an attended quantized layer: keep whole groups vs re-quantize the layer.

A demotion or commit-time compression removes a span's slots from every layer. The
attended tier keeps the surviving codes and statistics as they are (`select`); the
alternative it replaced dequantized the layer and re-quantized what was kept. Both
are timed here on one layer (SmolLM2-135M's shape: 3 KV heads, head dim 64), with
the full-precision layer's compaction for reference; medians of alternating rounds,
one thread, so a background load hits all three alike.

    .venv/bin/python scripts/attended_compaction.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from agentkv.store.attended import QuantizedAttendedLayer
from agentkv.store.cache import SharedPrefixLayer

TOKENS, DROPPED, SINKS, WINDOW = 2048, 500, 4, 64


def quantized_layer(k: torch.Tensor, v: torch.Tensor) -> QuantizedAttendedLayer:
    """Everything but the sinks and the residual window quantized (int4), as under full pressure."""
    layer = QuantizedAttendedLayer(4, 32, WINDOW)
    layer.update(k, v)
    layer.quantize(torch.arange(SINKS, TOKENS - WINDOW))
    return layer


def main() -> None:
    """Print the median milliseconds of each way to compact one layer."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    k, v = torch.randn(1, 3, TOKENS, 64), torch.randn(1, 3, TOKENS, 64)
    keep = torch.cat([torch.arange(0, 700), torch.arange(700 + DROPPED, TOKENS)])

    def keep_groups() -> float:
        layer = quantized_layer(k, v)
        started = time.perf_counter()
        layer.select(keep)
        return time.perf_counter() - started

    def requantize() -> float:
        layer = quantized_layer(k, v)
        started = time.perf_counter()
        full = layer.full()
        assert full is not None
        fresh = QuantizedAttendedLayer(4, 32, WINDOW)
        fresh.update(full[0].index_select(2, keep), full[1].index_select(2, keep))
        fresh.quantize(torch.arange(SINKS, int(keep.numel()) - WINDOW))
        return time.perf_counter() - started

    def full_precision() -> float:
        layer = SharedPrefixLayer()
        layer.update(k, v)
        started = time.perf_counter()
        layer.select(keep)
        return time.perf_counter() - started

    ways: dict[str, Callable[[], float]] = {
        "keep whole groups": keep_groups,
        "re-quantize": requantize,
        "fp32": full_precision,
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(15):
        for name, way in ways.items():
            times[name].append(way())
    print(f"one layer, {TOKENS} tokens, {DROPPED} removed (median ms):")
    for name, ts in times.items():
        print(f"  {name:18} {1e3 * statistics.median(ts):8.2f}")


if __name__ == "__main__":
    main()
