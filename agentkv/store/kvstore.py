"""The KV store: one session's KV across tiers, moved a whole span at a time.

The physical cache holds what the model attends to (tier `device`, or
`attended_quantized` for a span some of whose tokens it holds quantized); archived
spans live as blocks beside it (`quantized` on the model's device, `host` on the
CPU); dropped spans hold nothing but their token ids. Every move keeps the
byte accounting exact: `bytes_by_tier()` sums the tensors actually held. Each verb
returns the tier a span is on afterwards; the caller (the lifecycle's mover) writes it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import torch

from agentkv.config_sections import QuantizationConfig
from agentkv.spans import Span, SpanState, Tier
from agentkv.store.attended import QuantizedAttendedLayer, check_attended_spec, quantized_bytes
from agentkv.store.block import KVBlock, tensor_bytes
from agentkv.store.cache import LayerFactory, PhysicalCache, SharedPrefixLayer, WindowSpec
from agentkv.store.costs import ArchiveSpec, SlotBytes, settled_bytes, slot_bytes, slot_counts, span_costs
from agentkv.store.host import HostBlock, check_host_limit
from agentkv.store.key_planes import PLANE_KEY_BITS, fine_row_bytes
from agentkv.store.protocol import (
    ARCHIVE_TIERS,
    AttendedFloor,
    AttendedTokens,
    MoveResult,
    SpanCosts,
    TierBytes,
)
from agentkv.store.quantized import QuantizedBlock
from agentkv.store.store_checks import store_problems
from agentkv.store.tokens import keep_slots, read_tokens

__all__ = ["ARCHIVE_TIERS", "KVStore", "TierBytes"]


class KVStore:
    """Executes moves of spans between tiers on one session's cache (implements `KVStoreProtocol`).

    `host_limit_bytes` is a hard capacity of the host tier (None = the machine's memory):
    an offload past it raises `HostMemoryError`. It is not the host *budget*: the
    budget (`host_tokens` / `host_bytes`, resolved once by
    `agentkv.lifecycle.limits.BudgetLimits`) is enforced by the lifecycle with
    watermarks, evicting the lowest-scored host spans, as the device budget is.
    """

    def __init__(
        self,
        num_layers: int,
        device: torch.device,
        quantization: QuantizationConfig | None = None,
        *,
        host_limit_bytes: int | None = None,
        window: WindowSpec | None = None,
    ) -> None:
        """A store for `num_layers` layers on `device`, quantized as `quantization` says (None: defaults).

        `window`: the model's sliding layers, which hold (and archive) only the KV they can still attend.
        """
        quantization = quantization if quantization is not None else QuantizationConfig()
        group_size = quantization.group_size
        attended_bits: int | None = quantization.attended_bits
        attended_residual_tokens = quantization.attended_residual_tokens
        attended_key_bits: int | None = quantization.attended_key_bits
        factory: LayerFactory = SharedPrefixLayer
        if attended_bits is not None:
            check_attended_spec(
                attended_bits, group_size, attended_residual_tokens, key_bits=attended_key_bits
            )
            factory = partial(
                QuantizedAttendedLayer, attended_bits, group_size, attended_residual_tokens, attended_key_bits
            )
        self.physical = PhysicalCache(num_layers, factory, window=window)
        self.attended_bits = attended_bits
        """Bits of the attended quantized tier (None: the attended cache is full precision)."""
        self.attended_residual_tokens = attended_residual_tokens
        """The most recent tokens (by position) are never quantized in attention (KIVI's residual window)."""
        self.attended_key_bits = attended_key_bits
        """Bits of the attended tier's keys (None: `attended_bits`)."""
        self.attended_sink_tokens = quantization.attended_sink_tokens
        """The first positions are never quantized in attention (attention sinks: StreamingLLM, KVQuant)."""
        self.device = device
        self.group_size = group_size
        self.residual_tokens = quantization.residual_tokens
        self.host_limit_bytes = host_limit_bytes
        self.host_bits = quantization.host_bits
        """Bits of the host archive's quantized copies (None: full precision, restored exactly)."""
        self.blocks: dict[int, HostBlock | QuantizedBlock] = {}
        self.window_blocks: dict[int, HostBlock | QuantizedBlock] = {}
        """Sliding layers' KV of the slots they held, of archived spans (`blocks`: the full layers')."""

    # -- accounting ------------------------------------------------------------------------

    def bytes_by_tier(self) -> TierBytes:
        """Exact bytes per tier (sum of `numel * element_size` of the tensors held)."""
        # A snapshot of the blocks: the backend's global accounting may read a busy session
        # without its lock, and iterating the live dict could see it change size.
        blocks = [*self.blocks.values(), *self.window_blocks.values()]
        quantized = sum(b.nbytes for b in blocks if isinstance(b, QuantizedBlock))
        host = sum(b.nbytes for b in blocks if isinstance(b, HostBlock))
        return TierBytes(
            device=self._device_bytes(),
            quantized=quantized,
            host=host,
            shared=self.physical.shared_bytes(),
        )

    def _device_bytes(self) -> int:
        """The attended cache's bytes, removals not compacted yet counted as gone (codes counted exactly)."""
        physical = self.physical
        if not physical.variable_slot_bytes or bool(physical.live_mask().all()):
            return physical.nbytes()
        unit = self._slot_bytes()
        if unit is None:
            return physical.nbytes()
        return settled_bytes(slot_counts(physical, self._quantization_masks()[1]), unit)

    def _slot_bytes(self) -> SlotBytes | None:
        bits = self.attended_bits or 4
        key_bits = bits if self.attended_key_bits is None else self.attended_key_bits
        return slot_bytes(self.physical, bits=bits, key_bits=key_bits, group_size=self.group_size)

    def attended_costs(self, spans: Sequence[Span]) -> dict[int, SpanCosts]:
        """By attended span id: its bytes now, at each attended rung and archived (`agentkv.store.costs`).

        Without an attended quantized tier a span has no attended rung below its bytes now
        (nothing is quantizable), but its int8 / int4 archive still stays on the device and is
        counted. Empty before the first token.
        """
        unit = self._slot_bytes()
        if unit is None:
            return {}
        quantizable = self._quantization_masks()[1]
        if self.attended_bits is None:
            quantizable = torch.zeros_like(quantizable)
        counts = slot_counts(self.physical, quantizable)
        planes = self.attended_bits is not None and self.attended_key_bits == PLANE_KEY_BITS
        archive = ArchiveSpec(self.group_size, self.residual_tokens, self.host_bits)
        return span_costs([s for s in spans if s.tier.attended], counts, unit, planes=planes, archive=archive)

    def host_bytes(self) -> int:
        """Bytes on the host tier."""
        blocks = [*self.blocks.values(), *self.window_blocks.values()]
        return sum(b.nbytes for b in blocks if isinstance(b, HostBlock))

    def archived_device_bytes(self) -> int:
        """Bytes of the int8/int4 archive on the device; safe without the session's lock.

        The backend's global accounting reads busy sessions: a snapshot of the blocks, nothing
        of the attended cache, whose masks a running operation may hold at different lengths.
        """
        blocks = [*list(self.blocks.values()), *list(self.window_blocks.values())]
        return sum(b.nbytes for b in blocks if isinstance(b, QuantizedBlock))

    def span_bytes(self, span: Span) -> int:
        """Bytes held for a span in its tier."""
        if span.tier.attended:
            return self.physical.slots_bytes((self.physical.slot_span == span.span_id).nonzero().flatten())
        held = (self.blocks.get(span.span_id), self.window_blocks.get(span.span_id))
        return sum(block.nbytes for block in held if block is not None)

    # -- branches and lifetime -------------------------------------------------------------

    def fork(self) -> KVStore:
        """A branch's store: the attended cache shared as a read-only prefix, no archived blocks.

        Archived blocks are not copied: the branch sees those spans as evicted
        (recomputable from their tokens).
        """
        child = copy.copy(self)  # the same settings; its own cache and blocks below
        child.physical = self.physical.fork()
        child.blocks = {}
        child.window_blocks = {}
        return child

    def close(self) -> None:
        """Free every archived block and the attended cache."""
        self.blocks.clear()
        self.window_blocks.clear()
        self.physical.truncate(0)

    @contextmanager
    def deferred_removal(self) -> Iterator[None]:
        """Batch removals from the attended cache: one compaction for all the moves inside."""
        with self.physical.deferred_removal():
            yield

    def note_state(self, span: Span, before: SpanState, after: SpanState) -> None:
        """The in-process cache needs no notice of state changes: attention follows the tier."""

    # -- moves -----------------------------------------------------------------------------

    def quantize_attended_until(self, spans: Sequence[Span], free_bytes: int | None) -> MoveResult:
        """Quantize `spans` in attention, in order, until `free_bytes` are freed (None: all).

        Returns the bytes freed and, for each span quantized, its tier (ATTENDED_QUANTIZED).
        The attention sinks (the first `attended_sink_tokens` positions) and the residual
        window (the last `attended_residual_tokens` positions held) stay in full precision,
        as KIVI and KVQuant keep them; so do tokens already quantized.

        The spans one-by-one demotion would quantize, quantized in one pass over the layers:
        each span's saving is known before it is quantized (`quantized_bytes`: the exact
        rows it frees less the codes and statistics it takes), spans are taken until the
        savings reach `free_bytes`, and each keeps its own key groups, so the cache ends
        exactly as if they had been quantized one after another.
        """
        if self.attended_bits is None:
            return MoveResult()
        physical = self.physical
        # Removals not compacted yet are counted pro rata in `nbytes`; compacting settles
        # them, and what that frees counts toward `free_bytes` as it would one span at a time.
        estimated = physical.nbytes()
        physical.compact_pending()
        settled = estimated - physical.nbytes()
        chosen: list[torch.Tensor] = []
        taken: list[Span] = []
        planned = 0  # bytes the chosen spans free, known before quantizing them
        quantizable = self._quantization_masks()[1]  # nothing is quantized before the loop ends
        for span in spans:
            if free_bytes is not None and planned + settled >= free_bytes:
                break
            slots = self._attended_candidates(span, quantizable)
            if not slots.numel():
                continue
            # The first quantization turns the full-precision layers into attended quantized ones.
            physical.ensure_quantizable()
            layers = physical.cache.managed_layers
            chosen.append(slots)
            taken.append(span)
            for layer in layers:
                if isinstance(layer, QuantizedAttendedLayer):
                    exact, quantized = quantized_bytes(layer, int(slots.numel()))
                    planned += exact - quantized
        if not chosen:
            return MoveResult()
        before = physical.nbytes()
        physical.quantize_slots(chosen)
        return MoveResult(
            tiers={s.span_id: self.attended_tier(s) for s in taken}, freed=before - physical.nbytes()
        )

    def coarsen_attended_until(self, spans: Sequence[Span], free_bytes: int) -> int:
        """Hold the keys of `spans` at 4 bits, not 8, in order, until `free_bytes` are freed; bytes freed.

        The demotion between quantizing a span in attention and archiving one, for a tier
        with 8-bit keys (`agentkv.store.key_planes`): a span's fine key plane is dropped,
        its coarse codes and statistics are kept bit for bit. As `quantize_attended_until`,
        one pass over the layers: each span's saving is known before anything is dropped
        (its fine rows times a fine row's bytes in every layer), spans are taken in order
        until the savings reach `free_bytes`, and their planes are dropped together, so the
        cache ends as dropping them one span at a time would leave it. 0 without such a tier.
        """
        if self.attended_key_bits != PLANE_KEY_BITS:
            return 0
        physical = self.physical
        physical.compact_pending()
        layers = [x for x in physical.cache.managed_layers if isinstance(x, QuantizedAttendedLayer)]
        row_bytes = sum(fine_row_bytes(layer.key_fine) for layer in layers)
        if not layers or not row_bytes:
            return 0
        chosen: list[torch.Tensor] = []
        planned = 0
        for span in spans:
            if planned >= free_bytes:
                break
            if not span.tier.attended:
                continue
            slots = physical.slots_of(span.span_id)
            fine = slots[layers[0].is_fine(slots)] if slots.numel() else slots
            if fine.numel():
                chosen.append(fine)
                planned += int(fine.numel()) * row_bytes
        if not chosen:
            return 0
        before = physical.nbytes()
        drop = torch.cat(chosen)
        for layer in layers:
            layer.drop_fine(drop)
        return before - physical.nbytes()

    def fine_key_bytes(self) -> int:
        """Bytes of the fine key planes held (what holding every quantized key at 4 bits would free)."""
        return sum(
            tensor_bytes(layer.key_fine)
            for layer in self.physical.cache.managed_layers
            if isinstance(layer, QuantizedAttendedLayer) and layer.key_fine is not None
        )

    def fine_key_tokens(self, span: Span | None = None) -> int:
        """Slots whose keys are held at 8 bits in attention (of one span, or all)."""
        physical = self.physical
        layers = physical.quantizable_layers
        if not layers or not isinstance(layers[0], QuantizedAttendedLayer):
            return 0
        slots = torch.arange(physical.length) if span is None else physical.slots_of(span.span_id)
        return int(layers[0].is_fine(slots).sum())

    def quantizable_tokens(self, span: Span) -> int:
        """The span's slots quantizing it would take now (exact, neither sinks nor residual)."""
        return int(self._attended_candidates(span, self._quantization_masks()[1]).numel())

    def attended_token_counts(self, spans: Sequence[Span]) -> dict[int, tuple[int, int]]:
        """By span id: (slots held quantized in attention, slots quantizing the span would take now).

        What `attended_quantized_tokens` and `quantizable_tokens` say span by span, from
        one pass over the slots (the placement planner asks for every span on every plan).
        """
        quantized, quantizable = self._quantization_masks()
        slot_span = self.physical.slot_span
        held, more = _count_by_span(slot_span[quantized]), _count_by_span(slot_span[quantizable])
        return {
            s.span_id: (held.get(s.span_id, 0), more.get(s.span_id, 0) if s.tier.attended else 0)
            for s in spans
        }

    def _attended_candidates(self, span: Span, quantizable: torch.Tensor) -> torch.Tensor:
        """The span's slots among `quantizable` (`bool [length]`, `_quantization_masks`), in offset order."""
        if not span.tier.attended:
            return torch.empty(0, dtype=torch.long)
        slots = self.physical.slots_of(span.span_id)
        return slots[quantizable[slots]]

    def _quantization_masks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`bool [length]` each: the slots held quantized, and those the attended tier may quantize now.

        The second: exact, neither among the sinks nor in the residual window. Slots removed
        inside `deferred_removal` and not compacted yet are in neither.
        """
        physical = self.physical
        live = physical.live_mask()
        quantized = physical.quantized_mask(torch.arange(physical.length)) & live
        positions = physical.slot_position
        newest = int(positions.max()) if physical.length else 0
        sinks, residual = self.attended_sink_tokens, self.attended_residual_tokens
        window = (positions >= sinks) & (positions <= newest - residual)
        return quantized, window & live & ~quantized

    def attended_floor(self) -> AttendedFloor | None:
        """What attended KV costs held quantized, over all layers (see `AttendedFloor`).

        The least the budget can bring attended spans to before archiving one: what
        recall plans with. None without an attended quantized tier or before the first token.
        """
        unit = self._slot_bytes() if self.attended_bits is not None else None
        if unit is None:
            return None
        return unit.floor(self.attended_sink_tokens + self.attended_residual_tokens)

    def attended_quantized_tokens(self, span: Span | None = None) -> int:
        """Slots held quantized in attention (of one span, or all)."""
        physical = self.physical
        slots = torch.arange(physical.length) if span is None else physical.slots_of(span.span_id)
        return int(physical.quantized_mask(slots).sum())

    def attended_tier(self, span: Span) -> Tier:
        """The tier of an attended span, from its slots: quantized in attention when any of them is."""
        physical = self.physical
        quantized = bool(physical.quantized_mask(physical.slots_of(span.span_id)).any())
        return Tier.ATTENDED_QUANTIZED if quantized else Tier.DEVICE

    def quantized_offsets(self, span: Span) -> list[int]:
        """Offsets of the span's tokens held quantized in attention, sorted."""
        physical = self.physical
        slots = physical.slots_of(span.span_id)
        return sorted(physical.slot_offset[slots[physical.quantized_mask(slots)]].tolist())

    # -- token access (policies) -----------------------------------------------------------

    def attended_size(self) -> tuple[int, int] | None:
        """Attended slots and device bytes of one slot (token-mode eviction's arithmetic)."""
        return self.physical.length, self.physical.bytes_per_token()

    def attended_tokens(self, span: Span | None, *, keys: bool, queries: bool) -> AttendedTokens | None:
        """The attended tokens of `span` (or of the whole cache) as a policy reads them."""
        physical = self.physical
        slots = torch.arange(physical.length) if span is None else physical.slots_of(span.span_id)
        if not slots.numel():  # nothing of it attended: nothing to read
            return read_tokens(physical, slots, keys=False, queries=False)
        return read_tokens(physical, slots, keys=keys, queries=queries)

    def keep_attended(self, spans: Sequence[Span], keep: torch.Tensor) -> MoveResult:
        """Keep only the attended slots `keep`; tokens dropped and tiers, by span id (token-mode eviction)."""
        dropped = keep_slots(self.physical, spans, keep)
        tiers = {s.span_id: self.attended_tier(s) for s in spans if s.span_id in dropped}
        return MoveResult(tiers=tiers, dropped=dropped)

    def recompute_lazily(self, span: Span) -> Tier | None:
        """A dropped span becomes attended with every token pending: the next prefill computes it."""
        if span.tier is not Tier.DROPPED:
            return None
        span.n_computed = 0
        return self.adopt_recomputed(span)

    def compress(self, span: Span, keep_offsets: list[int]) -> MoveResult:
        """Keep only some of an attended span's tokens (commit-time compression); tokens dropped, its tier."""
        self._require_attended(span, "compress")
        keep = set(keep_offsets)
        slots = self.physical.slots_of(span.span_id)
        offsets = self.physical.slot_offset[slots]
        drop_mask = torch.tensor([int(o) not in keep for o in offsets.tolist()], dtype=torch.bool)
        dropped = self.physical.remove(slots[drop_mask])
        span.kept = sorted(int(o) for o in offsets[~drop_mask].tolist())
        tiers = {span.span_id: self.attended_tier(span)}
        return MoveResult(tiers=tiers, dropped={span.span_id: dropped} if dropped else {})

    def archive(self, span: Span, tier: str) -> Tier:
        """Move an attended span out of the attended cache into `host`, `int8`, `int4` or `drop`; its tier."""
        if tier not in ARCHIVE_TIERS:
            msg = f"archive tier: unknown {tier!r}; allowed: {', '.join(ARCHIVE_TIERS)}"
            raise ValueError(msg)
        self._require_attended(span, "archive")
        slots = self.physical.slots_of(span.span_id)
        if tier == "drop":
            return self.drop(span)
        window = self.physical.extract_window(slots)
        stored = self._archived(self.physical.extract(slots), tier)
        window_stored = None if window is None else self._archived(window, tier, adding=stored.nbytes)
        # Only remove from the attended cache once the archived copy exists (a failed move keeps the span).
        self.physical.remove(slots)
        self.blocks[span.span_id] = stored
        if window_stored is not None:
            self.window_blocks[span.span_id] = window_stored
        return Tier.HOST if tier == "host" else Tier.QUANTIZED

    def _archived(self, block: KVBlock, tier: str, adding: int = 0) -> HostBlock | QuantizedBlock:
        """The archive tier's copy of an extracted block (`adding`: bytes of this move already copied)."""
        if tier == "host":
            return self._host_copy(block, adding)
        return QuantizedBlock.from_block(
            block,
            bits=8 if tier == "int8" else 4,
            group_size=self.group_size,
            residual_tokens=self.residual_tokens,
        )

    def _host_copy(self, block: KVBlock, adding_before: int = 0) -> HostBlock:
        """The host tier's copy of an extracted block: quantized when `host_bits` asks and it is smaller.

        Per-channel key statistics cost a scale and a zero per channel per token group,
        however few tokens it holds, so a span of a few tokens can take more bytes
        quantized than in full precision: such a span is held exactly.

        Raises:
            HostMemoryError: The copy does not fit under `host_limit_bytes`.
        """
        stored: HostBlock | None = None
        if self.host_bits is not None:
            stored = HostBlock.offload_quantized(
                block, bits=self.host_bits, group_size=self.group_size, residual_tokens=self.residual_tokens
            )
            if stored.nbytes >= block.nbytes:
                stored = None
        adding = block.nbytes if stored is None else stored.nbytes
        check_host_limit(self.host_bytes() + adding_before, adding, self.host_limit_bytes)
        return stored or HostBlock.offload(block, fresh=True)  # `extract` made new tensors

    def archive_exact(self, span: Span) -> bool:
        """Whether an archived span's restore gives back its KV exactly (a full-precision host copy)."""
        held = [self.blocks.get(span.span_id), self.window_blocks.get(span.span_id)]
        return span.tier is Tier.HOST and all(
            isinstance(block, HostBlock) and block.bits is None for block in held if block is not None
        )

    def drop(self, span: Span) -> Tier:
        """Release a span's KV wherever it is (DROPPED); its token ids stay, so it can be recomputed."""
        if span.tier.attended:
            self.physical.remove(self.physical.slots_of(span.span_id))
        self.blocks.pop(span.span_id, None)
        self.window_blocks.pop(span.span_id, None)
        span.kept = None
        return Tier.DROPPED

    def recompute_pending(self, span: Span) -> Tier:
        """Drop an attended, uncompressed span's KV, its tokens left pending: the next forward recomputes it.

        The span stays attended, at full precision (DEVICE, returned); the session's next
        prefill encodes its tokens at their logical positions together with whatever else
        is pending (a new user turn), so recomputing it costs no forward of its own.
        """
        self._require_attended(span, "recompute")
        if span.kept is not None:
            msg = f"cannot recompute span {span.span_id} lazily: it was compressed at commit"
            raise ValueError(msg)
        self.physical.remove(self.physical.slots_of(span.span_id))
        span.n_computed = 0
        return Tier.DEVICE

    def restore(self, span: Span) -> Tier:
        """Bring an archived span back into the attended cache (appended at the physical end); its tier."""
        return self.restore_many([span]).tiers.get(span.span_id, span.tier)

    def restore_many(self, spans: Sequence[Span]) -> MoveResult:
        """Bring archived spans back with one append per layer (recall restores several at once).

        Each append copies the whole attended cache (`torch.cat`), so restoring k spans
        one by one would copy it k times. All or nothing: when the append fails, every
        span stays archived with its block. Restored spans are held at full precision (DEVICE).
        """
        items: list[tuple[int, KVBlock, torch.Tensor]] = []
        windows: list[KVBlock | None] = []
        restoring: list[Span] = []
        for span in spans:
            if span.tier.attended:
                continue
            stored = self.blocks.get(span.span_id)
            if stored is None:
                msg = f"span {span.span_id} holds no archived KV (tier {span.tier.value}); rehydrate it"
                raise ValueError(msg)
            block = self._block_back(stored)
            positions = torch.tensor([span.start + o for o in block.offsets], dtype=torch.long)
            items.append((span.span_id, block, positions))
            window = self.window_blocks.get(span.span_id)
            windows.append(None if window is None else self._block_back(window))
            restoring.append(span)
        self.physical.append_blocks(items, windows)
        self.physical.trim_window()  # restored sliding KV that died while archived
        for span in restoring:
            del self.blocks[span.span_id]
            self.window_blocks.pop(span.span_id, None)
        return MoveResult(tiers={s.span_id: Tier.DEVICE for s in restoring})

    def _block_back(self, stored: HostBlock | QuantizedBlock) -> KVBlock:
        """An archived block back on the device, in full precision."""
        if isinstance(stored, HostBlock):
            return stored.restore(self.device)
        return stored.to_block(device=self.device)

    def cut(self, span: Span, keep_tokens: int) -> Tier:
        """Keep only an attended span's first `keep_tokens` slots (a history rewrite); its tier."""
        physical = self.physical
        slots = physical.slots_of(span.span_id)
        physical.remove(slots[physical.slot_offset[slots] >= keep_tokens])
        return self.attended_tier(span)

    def adopt_recomputed(self, span: Span) -> Tier:
        """The span's KV was recomputed into the attended cache: at full precision (DEVICE), uncompressed."""
        span.kept = None
        return Tier.DEVICE

    def forget(self, span: Span) -> None:
        """Remove a span entirely (history rewrite): its slots and any archived block."""
        if span.tier.attended:
            self.physical.remove(self.physical.slots_of(span.span_id))
        self.blocks.pop(span.span_id, None)
        self.window_blocks.pop(span.span_id, None)

    def _require_attended(self, span: Span, action: str) -> None:
        if not span.tier.attended:
            msg = (
                f"cannot {action} span {span.span_id}: it is on tier {span.tier.value}, expected "
                f"{Tier.DEVICE.value} or {Tier.ATTENDED_QUANTIZED.value}"
            )
            raise ValueError(msg)

    # -- invariants ------------------------------------------------------------------------

    def check(self, spans: Sequence[Span]) -> list[str]:
        """Slots, blocks and byte accounting against the spans' tiers; one line per problem."""
        return store_problems(self, spans)


def _count_by_span(span_ids: torch.Tensor) -> dict[int, int]:
    """How many of `span_ids` (`long [n]`, one per slot) name each span."""
    ids, counts = torch.unique(span_ids, return_counts=True)
    return dict(zip(ids.tolist(), counts.tolist(), strict=True))
