"""The store's byte accounting against the tensors it holds: an independent oracle for tests.

`session.stats()` and `backend.device_bytes()` report the store's own sums; the functions here
walk the tensors themselves (layers, archived blocks, shared storages). They read the store's
physical cache on purpose: they test the store's accounting, the one thing the public API
cannot check against itself. Tests of anything else call them rather than reaching in.
"""

from __future__ import annotations

from typing import Any

import torch

from agentkv.store.attended import QuantizedAttendedLayer
from agentkv.store.host import HostBlock
from agentkv.store.quantized import QuantizedBlock


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def held_bytes(session: Any) -> tuple[int, int, int]:
    """(device, quantized, host) bytes, computed by walking the tensors themselves."""
    device = 0
    for layer in session.store.physical.cache.managed_layers:
        for t in (layer.prefix_keys, layer.prefix_values):
            device += _nbytes(t)
        if isinstance(layer, QuantizedAttendedLayer):  # exact slots, codes, statistics
            held = (layer.key_codes, layer.key_fine, layer.key_scales, layer.key_zeros, layer.value_codes)
            device += sum(_nbytes(t) for t in (*held, layer.value_scales, layer.value_zeros))
            if layer.exact_length:
                device += _nbytes(layer.keys) + _nbytes(layer.values)
        elif layer.own_length:
            device += _nbytes(layer.keys) + _nbytes(layer.values)
    quantized = host = 0
    for block in session.store.blocks.values():
        if isinstance(block, HostBlock):
            host += sum(_nbytes(t) for t in [*block.block.keys, *block.block.values])
        else:
            assert isinstance(block, QuantizedBlock)
            for q in [*block.keys, *block.values]:
                quantized += _nbytes(q.data) + _nbytes(q.scales) + _nbytes(q.zeros)
            for t in [*(block.residual_keys or []), *(block.residual_values or [])]:
                quantized += _nbytes(t)
    return device, quantized, host


def assert_tier_bytes(session: Any) -> tuple[int, int, int]:
    """Reported bytes per tier equal the tensors held; an exact slot costs one token's bytes.

    Returns the walked (device, quantized, host) bytes.
    """
    stats = session.stats()
    walked = held_bytes(session)
    assert (stats.device_bytes, stats.quantized_bytes, stats.host_bytes) == walked
    physical = session.store.physical
    if not physical.variable_slot_bytes:  # attended int4/int2 slots cost less than exact ones
        assert walked[0] == physical.length * session.runner.bytes_per_token
        assert stats.device_bytes == stats.attended_tokens * session.runner.bytes_per_token
    return walked


def global_device_bytes(backend: Any) -> int:
    """Device bytes of all sessions and the prefix cache, a storage shared by several counted once."""
    storages: dict[int, int] = {}
    quantized = 0
    held = [] if backend.prefix_cache is None else list(backend.prefix_cache.tensors())
    for session in backend.sessions():
        for layer in session.store.physical.cache.managed_layers:
            held += [*layer.prefix_tensors(), *layer.own_tensors()]
        quantized += held_bytes(session)[1]
    for t in held:
        if t.numel():
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values()) + quantized
