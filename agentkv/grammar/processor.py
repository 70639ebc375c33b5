"""The logits processor that keeps an answer inside a grammar, token by token."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from agentkv.grammar.compiled import CompiledGrammar
from agentkv.grammar.finishing import (
    CLOSING_WINDOW,
    RECHECK_AFTER,
    STOP_RANK,
    closing_choice,
    closing_rank,
)


class GrammarProcessor:
    """Masks the tokens a grammar does not allow next; a `LogitsProcessor` for `Session.generate`.

    Each call first advances the grammar by the tokens produced since the last call,
    then sets every disallowed token's logit to -inf. Once the grammar is complete
    only its stop tokens (the end of turn) remain, so the decode loop ends there.

    With a `budget`, the answer also ends inside it: near its end the processor keeps
    only the tokens on the shortest way to a complete answer (`agentkv.grammar.finishing`),
    so `max_new_tokens` never cuts a call or a JSON value in the middle.

    Args:
        compiled: the grammar (`compile_grammar`); this answer gets its own matcher.
        prefix_ids: the ids of text the answer starts with that was prefilled, not
            generated (a call's opening): the grammar is advanced through them first.
        budget: the answer's `max_new_tokens` (None: no finishing).
        tokenizer: the Hugging Face tokenizer (needed with `budget`, to rank closing tokens).
        stop_ids: the end-of-turn ids: allowed only once the grammar may end (and
            ranked for closing with `budget`).

    Raises:
        RuntimeError: the prefix or a produced token is outside the grammar (the mask
            makes the latter impossible; it means the ids came from elsewhere).
    """

    def __init__(
        self,
        compiled: CompiledGrammar,
        prefix_ids: Sequence[int] = (),
        *,
        budget: int | None = None,
        tokenizer: Any = None,
        stop_ids: Iterable[int] = (),
    ) -> None:
        self.compiled = compiled
        self.matcher = compiled.matcher()
        self.consumed = 0
        self.mask_calls = 0
        self.budget = budget
        self.finishing = False
        """True once the budget left is what the shortest completion needs."""
        self.next_check = 0
        self.stop_ids = sorted(set(stop_ids))
        """End-of-turn ids: allowed only where the grammar may end (whatever the tokenizer marks special)."""
        self.rank = closing_rank(tokenizer, set(self.stop_ids)) if budget is not None else None
        if prefix_ids and not self.matcher.consume_tokens(list(prefix_ids)):
            self._fail("the prefilled prefix")

    def __call__(self, produced: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """Logits `[V]` with the tokens the grammar forbids next at -inf."""
        new = list(produced[self.consumed :])
        if new and not self.matcher.consume_tokens(new):
            self._fail(f"generated token(s) {new}")
        self.consumed = len(produced)
        allowed = self.allowed(logits.shape[-1])
        self.mask_calls += 1
        if self.rank is not None and self.budget is not None:
            left = self.budget - len(produced)
            if not self.finishing and left <= CLOSING_WINDOW and len(produced) >= self.next_check:
                needed = self.closing_length(CLOSING_WINDOW, logits.shape[-1])
                self.finishing = needed is not None and needed >= left - 1
                # No way out found (free text before a call): look again a few tokens later.
                self.next_check = len(produced) + (RECHECK_AFTER if needed is None else 0)
            if self.finishing:
                allowed = closing_choice(allowed, self.rank)
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

    def closing_length(self, limit: int, vocab: int) -> int | None:
        """Tokens the shortest way to a complete answer takes from here, played out on a copy.

        None when closing tokens do not complete it within `limit` tokens (they do not
        help there, e.g. in the free text before a call).
        """
        rank = self.rank if self.rank is not None else torch.zeros(vocab)
        probe = self.matcher.deep_copy()
        for steps in range(limit):
            if probe.is_stopped():
                return steps
            packed = np.frombuffer(probe.compute_bitmask(), dtype=np.uint8)
            bits = torch.from_numpy(np.unpackbits(packed, bitorder="little")[:vocab].astype(np.bool_))
            choice = closing_choice(bits, rank)  # one token, or every allowed one when none closes
            token = int(torch.argmax(choice.int()))
            if rank[token] >= STOP_RANK:
                return steps + 1
            if not probe.consume_token(token):
                return None
        return None

    def allowed(self, vocab: int) -> torch.Tensor:
        """Which of `vocab` token ids the grammar allows next, `[vocab]` bool (ids past the tokenizer: no)."""
        packed = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(packed, bitorder="little")[:vocab]  # [<= vocab]
        if self.matcher.is_error():
            self._fail("the mask")
        allowed = torch.zeros(vocab, dtype=torch.bool)
        allowed[: bits.size] = torch.from_numpy(bits.astype(np.bool_))
        if self.stop_ids and not self.matcher.is_accepting():
            # A tokenizer that does not mark its end-of-turn token special lets the grammar read
            # it as text (inside a JSON string, say); the decode loop would stop there mid-call.
            allowed[[i for i in self.stop_ids if i < vocab]] = False
        return allowed

    @property
    def complete(self) -> bool:
        """Whether what was produced so far is a full sentence of the grammar."""
        return bool(self.matcher.is_accepting())

    def _fail(self, what: str) -> None:
        msg = f"constrained decoding: {what} left the grammar: {self.matcher.get_error()}"
        raise RuntimeError(msg)
