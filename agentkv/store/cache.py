"""The physical cache: the KV the model attends to, with per-slot bookkeeping.

The *logical* sequence (spans in conversation order, with RoPE positions) and the
*physical* cache (the tensors the model attends to) are allowed to differ:
tokens can be removed from the middle (compaction) and restored spans are
appended at the end. This is exact because keys carry the RoPE rotation of their
logical position and attention over a set of cached tokens does not depend on
their order (verified: a random permutation gives the same logits, docs/design.md §5).

Every physical slot records which span and which offset in it it holds, so the
store can lift a span out, put it back, or drop part of it.

A forked cache (tree-of-thought branch), or a session started from the
backend's prefix cache, attends tensors held elsewhere as a read-only prefix
instead of copying them (`agentkv.store.layer`); it materialises its own copy
when it must change that prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch

from agentkv.store.block import KVBlock, tensor_bytes
from agentkv.store.layer import LayerFactory, ManagedCache, SharedPrefixLayer
from agentkv.store.window import LayerSlots, WindowSpec, missing_slots

SLOT_FIELDS: tuple[str, ...] = (
    "slot_span",
    "slot_offset",
    "slot_position",
    "slot_attention",
    "slot_window_attention",
    "slot_heavy_attention",
    "slot_window",
)
"""The per-slot bookkeeping tensors `[S]`, kept aligned with the layers' tokens."""

__all__ = ["LayerFactory", "ManagedCache", "PhysicalCache", "SharedPrefixLayer", "WindowSpec"]


class PhysicalCache:
    """The attended KV of one session plus, for each physical slot, its span and offset.

    Bookkeeping tensors live on the CPU (they index, they are not attended):
    `slot_span[i]`, `slot_offset[i]`, `slot_position[i]` describe physical slot i.
    """

    def __init__(
        self,
        num_layers: int,
        layer_factory: LayerFactory = SharedPrefixLayer,
        *,
        window: WindowSpec | None = None,
    ) -> None:
        self.num_layers = num_layers
        self.window = window
        """The sliding layers and their window (None: none); they hold `slot_window` slots, full precision."""
        self.slots = LayerSlots(num_layers, window)
        """Which slots each layer holds (full layers all, sliding layers `slot_window`)."""
        self.sliding_layers = self.slots.sliding
        self.full_layers = self.slots.full
        self.context_source: Callable[[int], list[int]] | None = None
        """Token ids of logical positions `0 .. n - 1`, to recompute dropped sliding KV (`restore_window`)."""
        self.window_paused = 0  # > 0 inside `whole_window`
        self.window_recomputed_tokens = 0
        """Tokens a plain forward ran to recompute sliding KV a query needed (`restore_window`)."""
        self.layer_factory = layer_factory
        """The layers of the attended quantized tier (`SharedPrefixLayer`: no such tier).

        Every cache starts with full-precision `SharedPrefixLayer`s, whatever the tier:
        a cache nothing was ever quantized in is the plain cache (bit for bit) and shares
        its tensors with its forks. The first quantization turns its layers into
        `layer_factory` layers (`ensure_quantizable`).
        """
        self.cache = ManagedCache(num_layers)
        self.variable_slot_bytes = False
        """True once the layers are attended quantized ones: a slot's bytes depend on where it is."""
        self.slot_span = torch.empty(0, dtype=torch.long)
        self.slot_offset = torch.empty(0, dtype=torch.long)
        self.slot_position = torch.empty(0, dtype=torch.long)
        self.slot_attention = torch.empty(0, dtype=torch.float32)
        """Attention each slot has received, accumulated with an EMA (the lifecycle policy's signal)."""
        self.slot_window_attention = torch.empty(0, dtype=torch.float32)
        """Attention the last probed observation window paid to each slot (SnapKV, TOVA); 0 for new slots."""
        self.slot_heavy_attention = torch.empty(0, dtype=torch.float32)
        """Attention summed over every probed query, undecayed (H2O's accumulated score)."""
        self.slot_window = torch.empty(0, dtype=torch.bool)
        """Whether the sliding layers hold the slot (always True without sliding layers)."""
        self._pending: torch.Tensor | None = None
        """Inside `deferred_removal`: `[length]` bool, slots removed but not yet compacted away."""
        self._slot_bytes: tuple[int, int] | None = None
        """What one slot costs in the full layers and in the sliding layers, measured once."""

    # -- size and accounting -------------------------------------------------------------

    @property
    def length(self) -> int:
        """Physical slots held (attended tokens)."""
        return int(self.slot_span.numel())

    def own_bytes(self) -> int:
        """Bytes of the tensors this cache owns (not a shared prefix), less removals not compacted yet."""
        held = sum(tensor_bytes(t) for layer in self.cache.managed_layers for t in layer.own_tensors())
        return held - self._pending_bytes()

    def _pending_slots(self) -> int:
        """Slots removed inside `deferred_removal` and not compacted away yet."""
        return 0 if self._pending is None else int(self._pending.sum())

    def _pending_bytes(self) -> int:
        """Bytes of the slots removed inside `deferred_removal` and not compacted away yet.

        The global accounting reads a busy session without its lock (`device_bytes`), so
        this reads each tensor once: a mask whose length differs from the window flags'
        is a compaction under way, and its slots count as held (one operation stale).
        """
        pending, window = self._pending, self.slot_window
        if pending is None or pending.numel() != window.numel():
            return 0
        return self._slots_bytes(pending.nonzero().flatten(), window)

    @property
    def windowed(self) -> bool:
        """Whether some layers slide (and hold only the slots they can still attend)."""
        return self.window is not None

    def slot_bytes(self) -> tuple[int, int]:
        """Bytes one slot costs in the full layers and, when the sliding layers hold it, in those.

        Every layer of a kind holds a slot in the same dtype and shape: measured once from
        the tensors (a layer's bytes over the slots it holds), then `nbytes` is a product.
        """
        if self._slot_bytes is None and self.length:
            measured = self.slots.slot_bytes(self.cache.managed_layers)
            if not self.sliding_layers or bool(self.slot_window.any()):
                self._slot_bytes = measured
            return measured
        return self._slot_bytes or (0, 0)

    def slots_bytes(self, slots: torch.Tensor) -> int:
        """Bytes the cache holds for `slots` (`long [n]`): full layers always, sliding ones where held."""
        if not slots.numel():
            return 0
        return self._slots_bytes(slots, self.slot_window)

    def _slots_bytes(self, slots: torch.Tensor, window: torch.Tensor) -> int:
        """`slots_bytes` against given window flags (`bool [length]`), read once by the caller."""
        if self.variable_slot_bytes:
            return int(slots.numel()) * self.bytes_per_token()
        full, sliding = self.slot_bytes()
        return int(slots.numel()) * full + int(window[slots].sum()) * sliding

    def shared_bytes(self) -> int:
        """Bytes of the prefix tensors this cache shares with another one."""
        return sum(tensor_bytes(t) for layer in self.cache.managed_layers for t in layer.prefix_tensors())

    def nbytes(self) -> int:
        """Bytes of everything this cache attends to (own + shared), less removals not compacted yet."""
        if self.variable_slot_bytes:
            # Codes, statistics and the full-precision window: walk the tensors actually held.
            held = sum(tensor_bytes(t) for t in self.tensors())
            pending, length = self._pending_slots(), self.length
            return held - (held * min(pending, length) // length if pending and length else 0)
        full, sliding = self.slot_bytes()
        window = self.slot_window
        return int(window.numel()) * full + int(window.sum()) * sliding - self._pending_bytes()

    def tensors(self) -> Iterable[torch.Tensor]:
        """Every tensor referenced (own and shared), for global de-duplicated accounting."""
        for layer in self.cache.managed_layers:
            yield from layer.prefix_tensors()
            yield from layer.own_tensors()

    def bytes_per_token(self) -> int:
        """Bytes one slot costs across all layers (0 while nothing is cached).

        Every layer holds every slot in the same dtype and shape, so this is a constant
        of the cache: measured once from the tensors, after which `nbytes` is a product
        instead of a walk over every layer's tensors (budget checks read it after every
        move). `Session.check` compares it with a walk. Attended quantized layers hold
        a slot as codes or in the full-precision window, and sliding layers hold only
        the slots they can still attend: for them this is the mean over the slots held
        now (`slots_bytes` prices given slots exactly).
        """
        if self.variable_slot_bytes or self.windowed:
            # Attended quantized layers, or sliding layers holding some slots: the mean over the
            # slots held now (windows, codes and dead sliding KV differ).
            return sum(tensor_bytes(t) for t in self.tensors()) // self.length if self.length else 0
        return sum(self.slot_bytes())

    # -- bookkeeping after a forward ---------------------------------------------------------

    def record_append(
        self,
        span_ids: torch.Tensor,
        offsets: torch.Tensor,
        positions: torch.Tensor,
        *,
        window: torch.Tensor | None = None,
    ) -> None:
        """Record slots the model just appended (the forward already wrote their KV).

        `window` (`bool [n]`): which of them the sliding layers hold (None: all, as a forward appends).
        """
        span_ids = span_ids.reshape(-1)
        self.slot_span = torch.cat([self.slot_span, span_ids.to("cpu", torch.long)])
        self.slot_offset = torch.cat([self.slot_offset, offsets.to("cpu", torch.long)])
        self.slot_position = torch.cat([self.slot_position, positions.to("cpu", torch.long)])
        new = torch.zeros(int(span_ids.numel()))
        self.slot_attention = torch.cat([self.slot_attention, new])
        self.slot_window_attention = torch.cat([self.slot_window_attention, new])
        self.slot_heavy_attention = torch.cat([self.slot_heavy_attention, new])
        held = (
            torch.ones(int(span_ids.numel()), dtype=torch.bool) if window is None else window.to(torch.bool)
        )
        self.slot_window = torch.cat([self.slot_window, held])
        if self._pending is not None:
            with torch.inference_mode(False):  # appends run in a forward; the mask is written in place later
                grown = torch.zeros(int(span_ids.numel()), dtype=torch.bool)
                self._pending = torch.cat([self._pending, grown])
        self._check_lengths()

    def _check_lengths(self) -> None:
        problem = self.slots.problem(self.cache.managed_layers, self.length, self.slot_window)
        if problem:
            raise RuntimeError(problem)

    # -- queries ------------------------------------------------------------------------------

    def live_mask(self) -> torch.Tensor:
        """`bool [length]`: the slots held, less those removed inside `deferred_removal` and not compacted."""
        return torch.ones(self.length, dtype=torch.bool) if self._pending is None else ~self._pending

    def slots_of(self, span_id: int, offsets: Iterable[int] | None = None) -> torch.Tensor:
        """Physical slot indices of a span (optionally only some offsets), in offset order."""
        mask = self.slot_span == span_id
        if self._pending is not None:
            mask &= ~self._pending
        if offsets is not None:
            wanted = torch.tensor(sorted(set(offsets)), dtype=torch.long)
            mask &= torch.isin(self.slot_offset, wanted)
        slots = mask.nonzero().flatten()
        order = torch.argsort(self.slot_offset[slots])
        return slots[order]

    def layer_keys(self, layer_idx: int) -> torch.Tensor | None:
        """All attended keys of a layer, `[B, H_kv, S, D]` (None when empty; zeros: dead sliding slots)."""
        self.compact_pending()
        if layer_idx in self.sliding_layers:
            return self.layer_keys_at(layer_idx, torch.arange(self.length)) if self.length else None
        full = self.cache.managed_layers[layer_idx].full()
        return None if full is None else full[0]

    # -- moves ----------------------------------------------------------------------------

    def layer_keys_at(self, layer_idx: int, slots: torch.Tensor) -> torch.Tensor | None:
        """Keys of a layer at `slots` (`long [n]`), `[B, H_kv, n, D]` (None when empty); reads no more."""
        self.compact_pending()
        return self.slots.keys_at(self.cache.managed_layers, layer_idx, self.slot_window, slots)

    def extract(self, slots: torch.Tensor) -> KVBlock:
        """Copy the full layers' KV of some slots into a block (every layer without sliding ones)."""
        return self.slots.extract(self.cache.managed_layers, slots, self.slot_offset[slots].tolist())

    def extract_window(self, slots: torch.Tensor) -> KVBlock | None:
        """Copy the sliding layers' KV of those of `slots` they hold (None: none, or no sliding layer)."""
        offsets = self.slot_offset[slots].tolist()
        return self.slots.extract_window(self.cache.managed_layers, self.slot_window, slots, offsets)

    def remove(self, slots: torch.Tensor) -> int:
        """Drop some slots: mark, then one `index_select` per layer. Returns slots removed.

        Inside `deferred_removal` the slots are only marked; the compaction happens
        once, when the block ends.
        """
        if slots.numel() == 0:
            return 0
        if self._pending is not None:
            self._pending[slots] = True
            return int(slots.numel())
        keep_mask = torch.ones(self.length, dtype=torch.bool)
        keep_mask[slots] = False
        keep = keep_mask.nonzero().flatten()
        self._select(keep)
        return int(slots.numel())

    @contextmanager
    def deferred_removal(self) -> Iterator[None]:
        """Batch the `remove` calls made inside into one compaction at the end.

        Every compaction copies the whole cache (one `index_select` per layer), so
        demoting k spans in one budget check would copy it k times; batched, it is
        copied once. Inside the block, `slots_of` and `nbytes` already see the
        removals; anything that reads or grows the attended tensors (`layer_keys`,
        an append, a truncation) compacts first, so nothing ever attends a removed
        slot. Nested blocks compact when the outermost one ends.
        """
        if self._pending is not None:
            yield
            return
        self._pending = torch.zeros(self.length, dtype=torch.bool)
        try:
            yield
        finally:
            self.compact_pending()
            self._pending = None

    def compact_pending(self) -> None:
        """Compact the removals marked so far (before anything attends or grows the cache).

        Inside `deferred_removal` the block stays deferred for what follows.
        """
        pending = self._pending
        if pending is None or not bool(pending.any()):
            return
        self._select((~pending).nonzero().flatten())
        with torch.inference_mode(False):  # a forward inside the block compacts under inference mode
            self._pending = torch.zeros(self.length, dtype=torch.bool)

    def permute(self, order: torch.Tensor) -> None:
        """Reorder physical slots (tests use this to prove order does not matter)."""
        self.compact_pending()
        self._select(order)

    def truncate(self, length: int) -> None:
        """Keep only the first `length` physical slots."""
        self.compact_pending()
        if length < self.length:
            self._select(torch.arange(length))

    def accumulate_attention(self, attention: torch.Tensor, decay: float) -> None:
        """Fold a new attention signal `[S]` into the per-slot EMA."""
        self.compact_pending()
        if attention.numel() != self.length:
            return
        self.slot_attention = decay * self.slot_attention + attention.float().cpu()

    def observe_window(self, attention: torch.Tensor, heavy: torch.Tensor | None = None) -> None:
        """Record the last observation window's attention `[S]` and add `heavy` `[S]` to the sums.

        The window signal is *replaced* (SnapKV and TOVA score with the queries that
        just ran); `heavy` is the attention summed over every query of the forward
        and is *added*, undecayed, as H2O accumulates it. Signals of another length
        (a forward the probe saw only part of) are ignored.
        """
        self.compact_pending()
        if attention.numel() == self.length:
            self.slot_window_attention = attention.float().cpu().clone()
        if heavy is not None and heavy.numel() == self.length:
            self.slot_heavy_attention = self.slot_heavy_attention + heavy.float().cpu()

    def _select(self, keep: torch.Tensor) -> None:
        self.slots.select(self.cache.managed_layers, self.slot_window, keep)
        for name in SLOT_FIELDS:
            setattr(self, name, getattr(self, name)[keep])

    # -- sliding layers ------------------------------------------------------------------------

    def trim_window(self) -> int:
        """Drop the sliding layers' KV no later query can attend; slots dropped from them.

        Later queries are at the cache's next position or after (`max position + 1`);
        a recompute at old positions gets what it needs back (`missing_window`).
        """
        if self.window is None or self.window_paused or not self.length:
            return 0
        self.compact_pending()
        before = int(self.slot_window.sum())
        self.slot_window = self.slots.trim(self.cache.managed_layers, self.slot_window, self.slot_position)
        return before - int(self.slot_window.sum())

    def key_slots(self, new: int) -> dict[int, torch.Tensor]:
        """Per sliding layer, the slot of each key its kernel gets in a forward of `new` more tokens."""
        return self.slots.key_slots(self.slot_window, new)

    @contextmanager
    def whole_window(self) -> Iterator[None]:
        """Inside, the sliding layers keep every slot appended (a prefix about to be shared whole)."""
        self.window_paused += 1
        try:
            yield
        finally:
            self.window_paused -= 1

    def missing_window(self, positions: Sequence[int], hidden: torch.Tensor | None = None) -> torch.Tensor:
        """`long [m]`: held slots the sliding layers must hold for queries at `positions` and do not."""
        if self.window is None or not self.length:
            return torch.empty(0, dtype=torch.long)
        self.compact_pending()
        queries = torch.tensor(list(positions), dtype=torch.long)
        return missing_slots(self.slot_window, self.slot_position, queries, self.window.window, hidden)

    def hold_window(
        self, slots: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]
    ) -> None:
        """The sliding layers hold `slots` again: per sliding layer their `keys` / `values` `[B, H, n, D]`.

        `slots` (`long [n]`) are slots the sliding layers do not hold, the KV given in that order.
        """
        self.compact_pending()
        self.slot_window = self.slots.hold(self.cache.managed_layers, self.slot_window, slots, keys, values)
        self._check_lengths()

    # -- the attended quantized tier ----------------------------------------------------------

    def ensure_quantizable(self) -> bool:
        """Hold the layers as the attended quantized tier's layers; False when the cache has no such tier.

        Called before the first quantization. Each layer's slots move over as they are
        (exact, in place: no copy); a prefix shared with a fork is materialised, since
        quantized layers are not shared (the branch takes its own copy, as `fork` does).
        """
        if self.variable_slot_bytes:
            return True
        if self.layer_factory is SharedPrefixLayer or not self.full_layers:
            return False
        self.compact_pending()
        upgraded: list[SharedPrefixLayer] = []
        for i, layer in enumerate(self.cache.managed_layers):
            if i in self.sliding_layers:  # sliding layers hold a window's worth: kept full precision
                upgraded.append(layer)
                continue
            fresh = self.layer_factory()
            full = layer.full()
            if full is not None:
                fresh.set_all(full[0], full[1])
            upgraded.append(fresh)
        self.cache.layers[:] = upgraded
        self.variable_slot_bytes = True
        self._slot_bytes = None
        return True

    def quantize_slots(self, slots: torch.Tensor | Sequence[torch.Tensor]) -> int:
        """Hold some slots quantized in every layer (they stay attended). Returns slots quantized.

        `slots`: one set, or one set per span (each forms its own key groups). A cache
        without an attended quantized tier holds every slot in full precision and
        quantizes nothing (0).
        """
        self.compact_pending()
        sets = [slots] if isinstance(slots, torch.Tensor) else list(slots)
        if not any(s.numel() for s in sets) or not self.ensure_quantizable():
            return 0
        layers = self.quantizable_layers
        return type(layers[0]).quantize_all(layers, slots) if layers else 0

    @property
    def quantizable_layers(self) -> list[SharedPrefixLayer]:
        """The layers the attended quantized tier holds (the full layers; sliding ones stay exact)."""
        layers = self.cache.managed_layers
        return [layers[i] for i in self.full_layers]

    def quantized_mask(self, slots: torch.Tensor) -> torch.Tensor:
        """`bool [n]`: which of `slots` are held quantized in every layer.

        Layers agree unless a quantization failed half way; then the slots some layers
        still hold exact count as exact, so the next demotion quantizes them there too.
        """
        layers = self.quantizable_layers
        if not layers or not self.variable_slot_bytes:
            return torch.zeros(int(slots.numel()), dtype=torch.bool)
        mask = layers[0].is_quantized(slots)
        # Layers hold the same slots quantized (one count each to compare) unless a quantization
        # failed half way; only then is every layer asked.
        if len({getattr(layer, "quantized_length", 0) for layer in layers}) > 1:
            for layer in layers[1:]:
                mask &= layer.is_quantized(slots)
        return mask

    def append_block(self, span_id: int, block: KVBlock, positions: torch.Tensor) -> None:
        """Append a block's KV at the end of the physical cache (restore / recall)."""
        self.append_blocks([(span_id, block, positions)])

    def append_blocks(
        self,
        items: Sequence[tuple[int, KVBlock, torch.Tensor]],
        windows: Sequence[KVBlock | None] | None = None,
    ) -> None:
        """Append several `(span_id, block, positions)` at the end, with one update per layer.

        `block` holds the full layers' KV (`extract`); `windows[i]` the sliding layers' KV
        of some of item i's tokens (`extract_window`; None: the sliding layers hold none).
        All or nothing: if a layer fails half way (out of memory while copying back),
        the layers already written are cut back, so the caller can fall back to
        recomputing the spans on a cache that is still in sync.
        """
        if not items:
            return
        self.compact_pending()
        before = self.length
        blocks = [block for _, block, _ in items]
        sliding = [None] * len(items) if windows is None else list(windows)
        try:
            held = self.slots.append(self.cache.managed_layers, blocks, sliding)
            self.record_append(
                torch.cat([torch.full((b.num_tokens,), sid, dtype=torch.long) for sid, b, _ in items]),
                torch.tensor([o for b in blocks for o in b.offsets], dtype=torch.long),
                torch.cat([positions.to(torch.long) for _, _, positions in items]),
                window=held,
            )
        except BaseException:
            self.rollback(before)
            raise

    def rollback(self, length: int) -> None:
        """Undo a partly applied append: cut every layer and the bookkeeping back to `length` slots.

        A forward or a restore writes its KV layer after layer; when it fails half way,
        the first layers have grown and the others have not, and every later forward
        would fail on mismatched lengths. Appends only ever add at the end, so cutting
        each layer's own tensors back to `length` restores the state before the append.
        """
        self.slots.cut(self.cache.managed_layers, self.slot_window, length)
        if self.length > length:
            for name in SLOT_FIELDS:
                setattr(self, name, getattr(self, name)[:length])
        self._check_lengths()

    def attach_prefix(
        self,
        layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
        span_ids: torch.Tensor,
        offsets: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """Start an empty cache from a shared prefix: per layer `(keys, values)` `[B, H, n, D]`, not copied.

        `span_ids`, `offsets`, `positions` (`long [n]`) say which span tokens the n slots hold,
        as `record_append` does for a forward's tokens.
        """
        if self.length:
            msg = f"attach_prefix: the cache already holds {self.length} slots, expected none"
            raise ValueError(msg)
        for layer, (keys, values) in zip(self.cache.managed_layers, layers, strict=True):
            layer.attach_prefix(keys, values)
        self.record_append(span_ids, offsets, positions)

    def freeze_as_prefix(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Hold everything as a read-only prefix (no copy when nothing is shared yet); per layer `(K, V)`.

        Empty for a cache with an attended quantized tier (its layers are not shared).
        """
        self.compact_pending()
        if self.variable_slot_bytes or not bool(self.slot_window.all()):
            return []  # quantized layers are not shared; a prefix is shared whole (`whole_window`)
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in self.cache.managed_layers:
            layer.freeze_as_prefix()
            if layer.prefix_keys is None or layer.prefix_values is None:
                return []
            out.append((layer.prefix_keys, layer.prefix_values))
        return out

    def attends(self, tensor: torch.Tensor) -> bool:
        """Whether a tensor this cache attends shares `tensor`'s storage (a prefix cache reference)."""
        storage = tensor.untyped_storage().data_ptr()
        return any(t.untyped_storage().data_ptr() == storage for t in self.tensors() if t.numel())

    def fork(self) -> PhysicalCache:
        """A child cache sharing this cache's current tensors as its read-only prefix."""
        child = PhysicalCache(self.num_layers, self.layer_factory, window=self.window)
        child.context_source = self.context_source
        copied = self.variable_slot_bytes
        if copied:
            # Attended quantized layers are not shared: the branch holds its own copy (codes as they are).
            self.compact_pending()
            child.ensure_quantizable()
        for parent_layer, child_layer in zip(
            self.cache.managed_layers, child.cache.managed_layers, strict=True
        ):
            if copied:
                child_layer.copy_from(parent_layer)
                continue
            # Parent and child both keep the current tensors as a shared prefix and grow their own
            # suffixes: a plain DynamicLayer would copy the prefix into its next `torch.cat`.
            parent_layer.freeze_as_prefix()
            if parent_layer.prefix_keys is None or parent_layer.prefix_values is None:
                continue
            child_layer.attach_prefix(parent_layer.prefix_keys, parent_layer.prefix_values)
        for name in SLOT_FIELDS:
            setattr(child, name, getattr(self, name).clone())
        return child
