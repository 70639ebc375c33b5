"""The attended tier's read memo: the last dequantized read of each thread, by identity of what it read.

A layer is read by its attention and, right after, by the attention probe of the same
layer: the memo hands the probe the same tensors instead of a second dequantization.
Every change of a `QuantizedAttendedLayer` replaces one of its `HELD` tensors (none is
written in place), so identity of those tensors is enough to know the read is current.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

HELD = (
    "keys",
    "values",
    "key_codes",
    "key_fine",
    "key_scales",
    "key_zeros",
    "value_codes",
    "value_scales",
    "value_zeros",
)
"""The tensors a layer's contents live in: every change replaces one of them (none is written in place)."""


class _LastRead(threading.local):
    """The last dequantized read of one thread: which layer, the tensors it was read from, the result.

    Only weak references to the layer and its tensors, and only one layer's transient
    K/V (what its attention needed anyway): a memo that never holds a cache alive.
    """

    def __init__(self) -> None:
        self.layer: weakref.ref[Any] | None = None
        self.source: tuple[weakref.ref[torch.Tensor] | None, ...] = ()
        self.result: tuple[torch.Tensor, torch.Tensor] | None = None

    def get(self, layer: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.layer is None or self.layer() is not layer:
            return None
        # Identity, not `==` (a weak reference compares its referents, and tensors compare elementwise).
        for ref, tensor in zip(self.source, _held(layer), strict=True):
            if (ref is None) != (tensor is None) or (ref is not None and ref() is not tensor):
                return None
        return self.result

    def put(self, layer: Any, result: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.layer, self.result = weakref.ref(layer), result
        self.source = tuple(None if t is None else weakref.ref(t) for t in _held(layer))


def _held(layer: Any) -> tuple[torch.Tensor | None, ...]:
    """The tensors the layer's contents are in, and where its quantized slots sit."""
    return (*(getattr(layer, name) for name in HELD), layer.quant_index, layer.fine_index)


LAST_READ = _LastRead()
