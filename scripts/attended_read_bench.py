"""Per-layer read time of the attended quantized tier against a full-precision copy.

What one decode step pays per layer: `full()` (dequantize every quantized slot and place
it with the exact ones) and `update()` (append one exact token, then that read). The
shape is one SmolLM2-135M layer under full pressure, as `scripts/device_check.py` sets
it up: B=1, 3 kv heads, D=64, 2048 slots of which all but 4 sink tokens and a 64-token
window are quantized (KIVI groups of 32). The memo of the last read is cleared before
every timed read, so each one dequantizes.

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/attended_read_bench.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from agentkv.store import attended
from agentkv.store.attended import QuantizedAttendedLayer

SPECS = {"int4": (4, None), "int2": (2, None), "k4v2": (2, 4)}
"""Mode: (value bits, key bits)."""


def time_ms(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(best, median) milliseconds of `fn` over `repeats` calls, after two warm-up calls.

    The best is the figure to compare on a shared machine (a background load only adds).
    """
    fn()
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return min(times), statistics.median(times)


def layer_of(bits: int, key_bits: int | None, k: torch.Tensor, v: torch.Tensor) -> QuantizedAttendedLayer:
    """A layer holding `k`, `v` with every slot but the 4 sinks and the last 64 quantized."""
    layer = QuantizedAttendedLayer(bits, 32, 64, key_bits)
    layer.update(k, v)
    layer.quantize(torch.arange(4, int(k.shape[2]) - 64))
    return layer


def fresh_read(layer: QuantizedAttendedLayer) -> object:
    """`full()` with the memo of the last read cleared."""
    attended._LAST_READ.layer = None
    return layer.full()


def main() -> None:
    """Print the table: per mode, the best and median `full()` and `update()` times."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slots", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.manual_seed(0)
    shape = (1, args.heads, args.slots, args.head_dim)
    k, v = torch.randn(shape), torch.randn(shape)
    step_k, step_v = (
        torch.randn(1, args.heads, 1, args.head_dim),
        torch.randn(1, args.heads, 1, args.head_dim),
    )
    with torch.inference_mode():
        copy_ms = time_ms(lambda: (k.clone(), v.clone()), args.repeats)
        print(f"B=1 H={args.heads} N={args.slots} D={args.head_dim}, threads={torch.get_num_threads()}")
        print("ms per layer, best / median of", args.repeats)
        print(f"{'mode':6} {'quantized':>9} {'full()':>15} {'update()':>15} {'best x clone':>13}")
        print(f"{'clone':6} {0:9} {copy_ms[0]:7.3f} {copy_ms[1]:7.3f} {'':>15} {1.0:13.1f}")
        for mode, (bits, key_bits) in SPECS.items():
            layer = layer_of(bits, key_bits, k, v)
            read_ms = time_ms(lambda layer=layer: fresh_read(layer), args.repeats)
            # Decode appends grow the layer; a fresh one per mode keeps the sizes alike.
            grow = layer_of(bits, key_bits, k, v)
            update_ms = time_ms(lambda grow=grow: grow.update(step_k, step_v), args.repeats)
            print(
                f"{mode:6} {layer.quantized_length:9} {read_ms[0]:7.3f} {read_ms[1]:7.3f} "
                f"{update_ms[0]:7.3f} {update_ms[1]:7.3f} {read_ms[0] / copy_ms[0]:13.1f}"
            )


if __name__ == "__main__":
    main()
