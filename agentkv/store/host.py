"""The host tier: KV blocks held in CPU memory while their span is archived.

A tool call pause (InferCept, Continuum) or an archived span frees device memory
by moving its KV here; recall moves it back. The host copy always *owns* its
memory, so the tier's byte accounting never counts storage that the device cache
still holds (or frees) on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from agentkv.store.block import KVBlock
from agentkv.store.quantized import QuantizedBlock


class HostMemoryError(RuntimeError):
    """Adding a block to the host tier would exceed its byte limit."""

    def __init__(self, current: int, adding: int, limit: int) -> None:
        self.current = current
        """Bytes already held by the host tier."""
        self.adding = adding
        """Bytes that were to be added."""
        self.limit = limit
        """The host tier's limit in bytes."""
        msg = (
            f"host tier limit exceeded: {current} bytes held + {adding} bytes to add = "
            f"{current + adding} bytes, expected at most limit_bytes={limit}"
        )
        super().__init__(msg)


def check_host_limit(current: int, adding: int, limit: int | None) -> None:
    """Raise unless `adding` more bytes fit in the host tier.

    Used by the store before an offload (host budgets) and by fault injection
    (a tiny limit makes every offload fail).

    Args:
        current: Bytes the host tier holds now.
        adding: Bytes about to be added.
        limit: Host byte limit; None means unlimited.

    Raises:
        HostMemoryError: `current + adding > limit`.
        ValueError: A negative count or limit.
    """
    for name, value in (("current", current), ("adding", adding), ("limit", limit)):
        if value is not None and value < 0:
            msg = f"{name} must be >= 0 bytes, got {value}"
            raise ValueError(msg)
    if limit is not None and current + adding > limit:
        raise HostMemoryError(current, adding, limit)


@dataclass(eq=False)
class HostBlock:
    """A `KVBlock` whose tensors live on the CPU and own their storage, at full precision or quantized.

    Full precision (`offload`) restores exactly. Quantized (`offload_quantized`,
    `agentkv.quantization.host_bits`) holds KIVI-style int8 / int4 codes: about 1/4 /
    1/8 of the fp32 bytes plus scales, restored with the quantized tier's error.
    """

    block: KVBlock | QuantizedBlock
    """The host copy; on CUDA machines a full-precision copy's tensors are in pinned (page-locked) memory."""

    @classmethod
    def offload(cls, block: KVBlock, *, fresh: bool = False) -> HostBlock:
        """Copy a block to host memory.

        From CUDA, every tensor is copied asynchronously into pinned memory (pinned
        memory is what lets the copies run as DMA, and later lets `restore` be
        asynchronous too), then the source streams are synchronized once: a
        non-blocking device-to-host copy returns before the bytes have arrived, and
        the caller is about to treat the host copy as *the* copy (read it, account
        it, and drop the device tensors it came from). One sync after all layers'
        copies keeps the copies back to back.

        From the CPU, tensors are cloned, so the host copy does not share storage
        with (and keep alive) the device cache's tensors or a larger tensor a block
        tensor may be a view of.

        Args:
            block: The block to copy; it is not modified.
            fresh: The block's tensors are new copies nothing else references (what
                `PhysicalCache.extract` returns): CPU tensors are then kept as they
                are instead of being cloned a second time.

        Returns:
            The host block; its tensors are contiguous and own exactly their bytes.
        """
        devices: set[torch.device] = set()
        keys = [_to_host(k, devices, fresh=fresh) for k in block.keys]
        values = [_to_host(v, devices, fresh=fresh) for v in block.values]
        for device in devices:
            torch.cuda.current_stream(device).synchronize()
        return cls(KVBlock(keys=keys, values=values, offsets=list(block.offsets)))

    @classmethod
    def offload_quantized(
        cls, block: KVBlock, *, bits: int, group_size: int, residual_tokens: int = 0
    ) -> HostBlock:
        """Quantize a block where it is (on the GPU, where that is fast), then copy the codes to host memory.

        Args:
            block: The block to copy; it is not modified.
            bits: 8 or 4.
            group_size: Quantization group size (keys per channel over tokens, values per token).
            residual_tokens: Trailing tokens kept at full precision (see `QuantizedBlock.from_block`).

        Returns:
            The host block holding the quantized copy.
        """
        quantized = QuantizedBlock.from_block(
            block, bits=bits, group_size=group_size, residual_tokens=residual_tokens
        )
        return cls(quantized.to("cpu"))

    @property
    def bits(self) -> int | None:
        """Code width of a quantized copy; None for a full-precision one."""
        return self.block.keys[0].bits if isinstance(self.block, QuantizedBlock) and self.block.keys else None

    @property
    def num_tokens(self) -> int:
        """Number of tokens held."""
        return self.block.num_tokens

    @property
    def offsets(self) -> list[int]:
        """Offsets within the span of the tokens held (same as `QuantizedBlock.offsets`)."""
        return self.block.offsets

    @cached_property
    def nbytes(self) -> int:
        """Exact host bytes of every tensor held (computed once: a stored block never changes)."""
        return self.block.nbytes

    def restore(self, device: torch.device | str, non_blocking: bool = True) -> KVBlock:
        """Copy the block to `device`, into new tensors.

        A non-blocking host-to-device copy is ordered on the current stream, so
        kernels that later read the restored block on that stream see the data;
        PyTorch's pinned-memory allocator keeps the source pages alive until the copy
        is done, so this host block may be dropped right away. Restoring to the CPU
        clones, so the result never shares storage with the host tier.

        Args:
            device: Target device.
            non_blocking: Overlap the copy with the host (only effective from pinned memory to CUDA).

        Returns:
            A block on `device`.
        """
        if isinstance(self.block, QuantizedBlock):  # moves the compact codes, dequantizes on `device`
            return self.block.to_block(device=device)
        if torch.device(device).type == "cpu":
            return KVBlock(
                keys=[k.clone() for k in self.block.keys],
                values=[v.clone() for v in self.block.values],
                offsets=list(self.block.offsets),
            )
        return self.block.to(device, non_blocking=non_blocking)


def _to_host(t: torch.Tensor, cuda_devices: set[torch.device], *, fresh: bool = False) -> torch.Tensor:
    """A contiguous CPU copy of `t` that owns its storage; records CUDA sources to sync."""
    if t.device.type == "cpu":
        owns_storage = t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        if fresh and owns_storage:
            return t
        return t.clone(memory_format=torch.contiguous_format)
    if t.device.type == "cuda":
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        host.copy_(t, non_blocking=True)
        cuda_devices.add(t.device)
        return host
    # Other accelerators: a plain blocking copy (a new tensor, contiguous).
    return t.to("cpu").contiguous()
