"""Model forward verbs over a physical cache whose layout differs from the logical sequence.

Tokens are fed with their *logical* `position_ids` (RoPE) while the mask and the
cache grow physically. `generate()` would derive positions from the cache length,
which is wrong once tokens were removed or restored (docs/design.md §5), so the decode
loop is ours: `prefill`, then `decode_one_token` (as in gpt-fast).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from agentkv.backend.masks import FULL, SLIDING, AttentionLayout, Mask, check_logical_positions, logical_masks
from agentkv.backend.window_context import restore_window
from agentkv.policies import AttentionProbe, Policy, attention_window, needs_accumulated_attention
from agentkv.spans import Span
from agentkv.store.cache import PhysicalCache, WindowSpec
from agentkv.store.window import local_index

ATTENTION_DECAY = 0.9
"""EMA decay of the accumulated attention signal (H2O-style) collected on prefills."""


@dataclass(frozen=True)
class Feed:
    """Tokens to run through the model, with where they belong in the logical sequence."""

    input_ids: list[int]
    positions: list[int]
    span_ids: list[int]
    offsets: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)

    @staticmethod
    def pending(spans: Iterable[Span]) -> Feed:
        """Every token of attended spans whose KV is not computed yet, in logical order."""
        ids: list[int] = []
        positions: list[int] = []
        span_ids: list[int] = []
        offsets: list[int] = []
        for span in spans:
            if span.n_computed >= span.length or not span.tier.attended:
                continue
            for offset in range(span.n_computed, span.length):
                ids.append(span.token_ids[offset])
                positions.append(span.start + offset)
                span_ids.append(span.span_id)
                offsets.append(offset)
        return Feed(ids, positions, span_ids, offsets)

    def chunk(self, start: int, stop: int) -> Feed:
        """A slice of the feed."""
        return Feed(
            self.input_ids[start:stop],
            self.positions[start:stop],
            self.span_ids[start:stop],
            self.offsets[start:stop],
        )


class ModelRunner:
    """Runs a causal LM over a `PhysicalCache`."""

    def __init__(self, model: torch.nn.Module, *, prefill_chunk: int = 1024) -> None:
        self.model = model
        self.prefill_chunk = prefill_chunk
        config: Any = model.config
        text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self._text_config: Any = text_config
        self.num_layers: int = int(text_config.num_hidden_layers)
        check_logical_positions(text_config)
        self.layout = AttentionLayout.of(text_config)
        """Each layer's attention type; a windowed layout is masked by logical position on every forward."""
        self.window: WindowSpec | None = (
            WindowSpec(tuple(self.layout.layers_of(SLIDING)), self.layout.sliding_window)
            if self.layout.sliding_window is not None
            else None
        )
        """The sliding layers a session's cache holds only their window of (None: no sliding layer)."""
        self.max_positions: int | None = getattr(text_config, "max_position_embeddings", None)
        self.device: torch.device = next(model.parameters()).device
        self.dtype: torch.dtype = next(model.parameters()).dtype
        kv_heads = int(getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads)
        head_dim = int(
            getattr(text_config, "head_dim", None)
            or text_config.hidden_size // text_config.num_attention_heads
        )
        self.bytes_per_token: int = 2 * self.num_layers * kv_heads * head_dim * self.dtype.itemsize
        """Full-precision KV bytes one token costs across all layers (keys and values)."""
        self.model_lock = threading.RLock()
        """Serialises the model's use (the backend's `model_lock`): a probe reroutes every call."""
        self.forward_seconds = 0.0
        self.forward_tokens = 0
        self._background: dict[tuple[int, ...], torch.Tensor] = {}

    @torch.inference_mode()
    def background_logprobs(self, context: list[int]) -> torch.Tensor:
        """The model's next-token log-probabilities after `context` alone, `[V]` on the CPU (cached).

        With a bare newline as the context this is the model's own estimate of how common
        each token is at the start of a line: recall weighs a word by how surprising it is
        there, so "what", "the" and "?" count for little next to "insurance" or a code.
        """
        key = tuple(context)
        cached = self._background.get(key)
        if cached is None:
            ids = torch.tensor([context], dtype=torch.long, device=self.device)
            logits = self.model(input_ids=ids, use_cache=False).logits[0, -1]  # [V]
            cached = torch.log_softmax(logits.float(), dim=-1).cpu()
            self._background[key] = cached
        return cached

    @torch.inference_mode()
    def forward(
        self,
        cache: PhysicalCache,
        feed: Feed,
        *,
        logits: str = "last",
        attention_mask: Mask | None = None,
        probe: AttentionProbe | None = None,
    ) -> torch.Tensor | None:
        """Run `feed` through the model, appending its KV to `cache`.

        Args:
            cache: the session's physical cache; grows by `len(feed)` slots.
            feed: tokens with logical positions and span bookkeeping.
            logits: "last" returns `[V]` for the last token, "all" returns `[n, V]`, "none" returns None.
            attention_mask: optional masks `[1, 1, n, S + n]` as `logical_mask` builds them (in the
                form the model's attention implementation takes); only for single-chunk feeds.
                None = attend to every cached slot, causal among new tokens: on a windowed
                model, each chunk's masks are built by logical position (`logical_mask`).
            probe: the attention probe the forward runs under, if any: on a cache whose sliding
                layers hold a subset of the slots, it is told which slot each of their keys is.
        """
        import time

        if len(feed) == 0:
            return None
        chunk = self.prefill_chunk if attention_mask is None else len(feed)
        started = time.perf_counter()
        before = cache.length
        try:
            outputs = self._forward_chunks(cache, feed, chunk, logits, attention_mask, probe)
        except BaseException:
            # A forward that fails half way has grown some layers and not others: cut back,
            # so the session stays usable and the feed's tokens simply remain pending.
            cache.rollback(before)
            raise
        self.forward_seconds += time.perf_counter() - started
        self.forward_tokens += len(feed)
        if logits == "none" or not outputs:
            return None
        if logits == "last":
            return outputs[-1][-1]
        return torch.cat(outputs, dim=0)

    def _forward_chunks(
        self,
        cache: PhysicalCache,
        feed: Feed,
        chunk: int,
        logits: str,
        attention_mask: Mask | None,
        probe: AttentionProbe | None,
    ) -> list[torch.Tensor]:
        """The chunked forwards of `forward`; returns the logits rows it was asked to keep."""
        outputs: list[torch.Tensor] = []
        for begin in range(0, len(feed), chunk):
            part = feed.chunk(begin, begin + chunk)
            last_chunk = begin + chunk >= len(feed)
            want = logits == "all" or (logits == "last" and last_chunk)
            input_ids = torch.tensor([part.input_ids], dtype=torch.long, device=self.device)  # [1, n]
            position_ids = torch.tensor([part.positions], dtype=torch.long, device=self.device)  # [1, n]
            mask = attention_mask
            if mask is None and self.layout.windowed:
                # transformers would size each window by physical slots: the window is by position.
                mask = self.logical_mask(cache, part.positions)
            if probe is not None and cache.windowed:  # after `logical_mask`: it may restore sliding KV
                probe.key_slots = cache.key_slots(len(part))
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=mask,
                cache=cache.cache,
                use_cache=True,
                logits_to_keep=0 if logits == "all" else 1,
            )
            cache.record_append(
                torch.tensor(part.span_ids), torch.tensor(part.offsets), torch.tensor(part.positions)
            )
            cache.trim_window()  # sliding KV no later query can attend is dropped
            if want:
                outputs.append(out.logits[0].float())  # [n or 1, V]
        return outputs

    def forward_observed(
        self, cache: PhysicalCache, feed: Feed, policy: Policy | None, *, window: int, **kwargs: Any
    ) -> torch.Tensor | None:
        """`forward`, collecting the attention signals on prefills when `policy` uses them.

        The probe runs with the policy's own observation window (SnapKV's `window`, TOVA's
        last query; `window` when the policy names none, see `attention_window`). Its
        attention is kept three ways on the cache's slots: replaced as the last window's
        (SnapKV, TOVA), folded into an EMA (the kind-prior policy), and, when the policy
        asks for it (`needs_accumulated_attention`, H2O), summed over every query of the
        forward. Forwards with an explicit mask (rehydration) and single-token decode
        steps skip it.
        """
        wants = policy is not None and policy.needs_attention and len(feed) > 1
        if not wants or kwargs.get("attention_mask") is not None:
            return self.forward(cache, feed, **kwargs)
        probed = min(len(feed), attention_window(policy, default=window))
        heavy = needs_accumulated_attention(policy)
        with AttentionProbe(self.model, window=probed, heavy=heavy) as probe:
            logits = self.forward(cache, feed, probe=probe, **kwargs)
        attention = probe.attention()
        cache.accumulate_attention(attention, ATTENTION_DECAY)
        cache.observe_window(attention, probe.heavy_attention() if heavy else None)
        return logits

    def logical_mask(
        self, cache: PhysicalCache, positions: list[int], hidden: torch.Tensor | None = None
    ) -> Mask:
        """Masks letting each new token attend only to what a plain forward shows it, `[1, 1, n, S + n]`.

        By logical position: slots before the token (and, on sliding layers, within the
        window), wherever they sit in the physical cache. Used to recompute (rehydrate)
        a span in the middle of the logical sequence, which must not see tokens that
        came after it in the conversation, and on every forward of a windowed model.
        `hidden` (`long`, physical slots) are masked out as well: the old copies of
        tokens being recomputed. One mask, or a dict by layer type for a hybrid model
        (`agentkv.backend.masks.logical_masks`), in the form the model's current attention
        implementation reads (read per call: `model.set_attn_implementation` switches it).
        On a cache whose sliding layers hold only their window, sliding layers get their own
        key positions, and sliding KV the queries attend that was dropped (a recompute at old
        positions) is recomputed first (`restore_window`): build the mask right before its forward.

        Raises:
            ValueError: The attention implementation cannot take an arbitrary 4D mask
                (FlashAttention kernels only know causal and padding masks).
        """
        if cache.windowed:
            # Sliding KV a query needs and the cache no longer holds (a recompute at old positions).
            with self.model_lock:
                restore_window(self.model, cache, positions, hidden, chunk=self.prefill_chunk)
        past = cache.slot_position.to(self.device)  # [S]
        new = torch.tensor(positions, dtype=torch.long, device=self.device)  # [n]
        all_keys = torch.cat([past, new])  # [S + n]
        keys: torch.Tensor | dict[str, torch.Tensor] = all_keys
        hide: torch.Tensor | dict[str, torch.Tensor] | None = hidden
        if cache.windowed:
            # Sliding layers hold only the slots they can still attend: their keys are those.
            held = cache.slot_window
            keys = {FULL: all_keys, SLIDING: torch.cat([past[held.to(self.device)], new])}  # [S_w + n]
            if hidden is not None:
                local = local_index(held)[hidden.cpu()][held[hidden.cpu()]]
                hide = {FULL: hidden, SLIDING: local}
        return logical_masks(
            self.layout,
            keys,
            new,
            implementation=self.attention_implementation,
            dtype=self.dtype,
            hidden=hide,
        )

    @property
    def attention_implementation(self) -> str:
        """The model's attention implementation now (`"sdpa"`, `"eager"`, …); "eager" when unset."""
        config: Any = self.model.config
        return str(
            getattr(self._text_config, "_attn_implementation", None)
            or getattr(config, "_attn_implementation", None)
            or "eager"
        )
