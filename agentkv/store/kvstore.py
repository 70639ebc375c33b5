"""The KV store: one session's KV across tiers, moved a whole span at a time.

The physical cache holds what the model attends to (tier `device`); archived
spans live as blocks beside it (`quantized` on the model's device, `host` on the
CPU); dropped spans hold nothing but their token ids. Every move keeps the
byte accounting exact: `bytes_by_tier()` sums the tensors actually held.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch

from agentkv.spans import Span, Tier
from agentkv.store.attended import QuantizedAttendedLayer, check_attended_spec
from agentkv.store.block import KVBlock
from agentkv.store.cache import LayerFactory, PhysicalCache, SharedPrefixLayer
from agentkv.store.host import HostBlock, check_host_limit
from agentkv.store.quantized import QuantizedBlock

ARCHIVE_TIERS = ("host", "int8", "int4", "drop")


@dataclass(frozen=True)
class TierBytes:
    """Bytes held per tier, now."""

    device: int
    quantized: int
    host: int
    shared: int = 0
    """Part of `device` that is a prefix shared with a parent session (not owned)."""


class KVStore:
    """Executes moves of spans between tiers on one session's cache."""

    def __init__(
        self,
        num_layers: int,
        device: torch.device,
        *,
        group_size: int = 32,
        residual_tokens: int = 0,
        host_limit_bytes: int | None = None,
        attended_bits: int | None = None,
        attended_residual_tokens: int = 64,
    ) -> None:
        factory: LayerFactory = SharedPrefixLayer
        if attended_bits is not None:
            check_attended_spec(attended_bits, group_size, attended_residual_tokens)
            factory = partial(QuantizedAttendedLayer, attended_bits, group_size, attended_residual_tokens)
        self.physical = PhysicalCache(num_layers, factory)
        self.attended_bits = attended_bits
        """Bits of the attended quantized tier (None: the attended cache is full precision)."""
        self.device = device
        self.group_size = group_size
        self.residual_tokens = residual_tokens
        self.host_limit_bytes = host_limit_bytes
        self.blocks: dict[int, HostBlock | QuantizedBlock] = {}

    # -- accounting ------------------------------------------------------------------------

    def bytes_by_tier(self) -> TierBytes:
        """Exact bytes per tier (sum of `numel * element_size` of the tensors held)."""
        # A snapshot of the blocks: the backend's global accounting may read a busy session
        # without its lock, and iterating the live dict could see it change size.
        blocks = list(self.blocks.values())
        quantized = sum(b.nbytes for b in blocks if isinstance(b, QuantizedBlock))
        host = sum(b.nbytes for b in blocks if isinstance(b, HostBlock))
        return TierBytes(
            device=self.physical.nbytes(), quantized=quantized, host=host, shared=self.physical.shared_bytes()
        )

    def host_bytes(self) -> int:
        """Bytes on the host tier."""
        return sum(b.nbytes for b in self.blocks.values() if isinstance(b, HostBlock))

    # -- moves -----------------------------------------------------------------------------

    def compress(self, span: Span, keep_offsets: list[int]) -> int:
        """Keep only some of a device span's tokens (commit-time compression). Returns tokens dropped."""
        self._require(span, Tier.DEVICE, "compress")
        keep = set(keep_offsets)
        slots = self.physical.slots_of(span.span_id)
        offsets = self.physical.slot_offset[slots]
        drop_mask = torch.tensor([int(o) not in keep for o in offsets.tolist()], dtype=torch.bool)
        dropped = self.physical.remove(slots[drop_mask])
        span.kept = sorted(int(o) for o in offsets[~drop_mask].tolist())
        return dropped

    def archive(self, span: Span, tier: str) -> None:
        """Move a device span out of the attended cache into `host`, `int8`, `int4` or `drop`."""
        if tier not in ARCHIVE_TIERS:
            msg = f"archive tier: unknown {tier!r}; allowed: {', '.join(ARCHIVE_TIERS)}"
            raise ValueError(msg)
        self._require(span, Tier.DEVICE, "archive")
        slots = self.physical.slots_of(span.span_id)
        if tier == "drop":
            self.drop(span)
            return
        block = self.physical.extract(slots)
        stored: HostBlock | QuantizedBlock
        if tier == "host":
            check_host_limit(self.host_bytes(), block.nbytes, self.host_limit_bytes)
            stored = HostBlock.offload(block, fresh=True)  # `extract` made new tensors
            new_tier = Tier.HOST
        else:
            stored = QuantizedBlock.from_block(
                block,
                bits=8 if tier == "int8" else 4,
                group_size=self.group_size,
                residual_tokens=self.residual_tokens,
            )
            new_tier = Tier.QUANTIZED
        # Only remove from the attended cache once the archived copy exists (a failed move keeps the span).
        self.physical.remove(slots)
        self.blocks[span.span_id] = stored
        span.tier = new_tier

    def drop(self, span: Span) -> None:
        """Release a span's KV wherever it is; its token ids stay, so it can be recomputed."""
        if span.tier is Tier.DEVICE:
            self.physical.remove(self.physical.slots_of(span.span_id))
        self.blocks.pop(span.span_id, None)
        span.tier = Tier.DROPPED
        span.kept = None

    def restore(self, span: Span) -> None:
        """Bring an archived span back into the attended cache (appended at the physical end)."""
        self.restore_many([span])

    def restore_many(self, spans: Sequence[Span]) -> None:
        """Bring archived spans back with one append per layer (recall restores several at once).

        Each append copies the whole attended cache (`torch.cat`), so restoring k spans
        one by one would copy it k times. All or nothing: when the append fails, every
        span stays archived with its block.
        """
        items: list[tuple[int, KVBlock, torch.Tensor]] = []
        restoring: list[Span] = []
        for span in spans:
            if span.tier is Tier.DEVICE:
                continue
            stored = self.blocks.get(span.span_id)
            if stored is None:
                msg = f"span {span.span_id} holds no archived KV (tier {span.tier.value}); rehydrate it"
                raise ValueError(msg)
            if isinstance(stored, HostBlock):
                block = stored.restore(self.device)
            else:
                block = stored.to_block(device=self.device)
            positions = torch.tensor([span.start + o for o in block.offsets], dtype=torch.long)
            items.append((span.span_id, block, positions))
            restoring.append(span)
        self.physical.append_blocks(items)
        for span in restoring:
            del self.blocks[span.span_id]
            span.tier = Tier.DEVICE

    def forget(self, span: Span) -> None:
        """Remove a span entirely (history rewrite): its slots and any archived block."""
        if span.tier is Tier.DEVICE:
            self.physical.remove(self.physical.slots_of(span.span_id))
        self.blocks.pop(span.span_id, None)

    def _require(self, span: Span, tier: Tier, action: str) -> None:
        if span.tier is not tier:
            msg = (
                f"cannot {action} span {span.span_id}: it is on tier {span.tier.value}, expected {tier.value}"
            )
            raise ValueError(msg)
