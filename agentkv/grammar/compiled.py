"""Grammars compiled once per tokenizer and grammar text, and copied for each answer."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import llguidance

from agentkv.grammar.grammars import GrammarError, check_grammar
from agentkv.grammar.tokenizer import grammar_tokenizer

CACHE_SIZE = 256
"""Compiled grammars kept (least recently used dropped first): one per tool set / schema in use."""


@dataclass(frozen=True)
class CompiledGrammar:
    """A grammar bound to a tokenizer; `matcher()` hands out a fresh copy of its start state."""

    lark: str
    tokenizer: llguidance.LLTokenizer
    pristine: llguidance.LLMatcher
    compile_seconds: float
    """How long building it took (the cost the cache saves on every later answer)."""

    def matcher(self) -> llguidance.LLMatcher:
        """A matcher at the grammar's start (a copy: microseconds, against milliseconds to build)."""
        return self.pristine.deep_copy()


_CACHE: OrderedDict[tuple[int, tuple[int, ...], str], tuple[Any, CompiledGrammar]] = OrderedDict()
_LOCK = threading.Lock()


def compile_grammar(
    tokenizer: Any, stop_ids: Iterable[int], lark: str, *, where: str = "grammar"
) -> CompiledGrammar:
    """The compiled form of `lark` for `tokenizer` (cached by tokenizer, stop ids and text).

    Args:
        tokenizer: the model's Hugging Face (fast) tokenizer.
        stop_ids: the end-of-turn token ids the grammar ends with.
        lark: the grammar (see `agentkv.grammar.grammars`).
        where: what the grammar came from, named in errors.

    Raises:
        GrammarError: the grammar library cannot build it.
    """
    stops = tuple(sorted(set(stop_ids)))
    key = (id(tokenizer), stops, lark)
    with _LOCK:
        held = _CACHE.get(key)
        if held is not None and held[0] is tokenizer:
            _CACHE.move_to_end(key)
            return held[1]
    started = time.perf_counter()
    grammar = check_grammar(lark, where)
    lltokenizer = grammar_tokenizer(tokenizer, stops)
    matcher = llguidance.LLMatcher(lltokenizer, grammar, log_level=0)
    if matcher.is_error():
        msg = f"{where}: the grammar library cannot build this grammar: {matcher.get_error()}"
        raise GrammarError(msg)
    compiled = CompiledGrammar(lark, lltokenizer, matcher, time.perf_counter() - started)
    with _LOCK:
        _CACHE[key] = (tokenizer, compiled)
        while len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)
    return compiled
