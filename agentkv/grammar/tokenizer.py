"""The grammar library's view of a Hugging Face tokenizer, built once per tokenizer."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import llguidance
import llguidance.hf

_CACHE: dict[tuple[int, tuple[int, ...]], tuple[Any, llguidance.LLTokenizer]] = {}
_LOCK = threading.Lock()


def grammar_tokenizer(tokenizer: Any, stop_ids: Iterable[int]) -> llguidance.LLTokenizer:
    """An `LLTokenizer` for `tokenizer` whose end-of-sequence tokens are `stop_ids` (cached).

    The stop ids are the chat template's end-of-turn tokens: when a grammar is
    complete it allows only those, and the decode loop ends the answer on them.
    Building one reads the whole vocabulary (about a second), hence the cache,
    keyed by the tokenizer object and the stop ids.

    Raises:
        TypeError: `tokenizer` is not a fast (Rust-backed) tokenizer.
    """
    stops = tuple(sorted(set(stop_ids)))
    key = (id(tokenizer), stops)
    with _LOCK:
        held = _CACHE.get(key)
        if held is not None and held[0] is tokenizer:
            return held[1]
        if getattr(tokenizer, "backend_tokenizer", None) is None:
            msg = (
                f"constrained decoding needs a fast (Rust) tokenizer, got {type(tokenizer).__name__}; "
                "load the model's tokenizer with use_fast=True"
            )
            raise TypeError(msg)
        built = llguidance.hf.from_tokenizer(tokenizer, eos_token=list(stops) or None)
        _CACHE[key] = (tokenizer, built)
        return built
