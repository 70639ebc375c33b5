"""The shortest way from a grammar state to a complete answer, searched on copies of the matcher.

Closing tokens (`agentkv.grammar.finishing.closing_choice`) decide most steps: close
the string, the object, the array, end the turn. Where none is allowed (a required
key's name, an enum value, a tool's name) the search branches over the longest
allowed tokens, depth first with the longest first, and keeps the shortest way found
within a step budget. A way is a list of token ids ending with the end of turn, with
the grammar stopped, or where the caller's `tail` completes the answer (a forced call
ends when its JSON closes; the caller adds the close tag), so the processor can spend
it token by token: the rest of a way is a way from the next state, which keeps one
that fits fitting.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import numpy as np
import torch

from agentkv.grammar.finishing import STOP_RANK, closing_choice, token_lengths

BRANCHES = 6
"""Tokens tried where no closing token is allowed (the longest ones)."""
SEARCH_STEPS = 512
"""Grammar steps one search may take (each one computes a mask): past them, the best way so far."""


def allowed_tokens(matcher: llguidance.LLMatcher, vocab: int, stop_ids: Sequence[int]) -> torch.Tensor:
    """Which of `vocab` ids `matcher` allows next, `[vocab]` bool; `stop_ids` only where it may end.

    A tokenizer that does not mark its end-of-turn token special lets the grammar read it
    as text (inside a JSON string, say); the decode loop would stop there mid-answer.
    """
    packed = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    bits = np.unpackbits(packed, bitorder="little")[:vocab]  # [<= vocab]
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[: bits.size] = torch.from_numpy(bits.astype(np.bool_))
    if stop_ids and not matcher.is_accepting():
        allowed[[i for i in stop_ids if i < vocab]] = False
    return allowed


class WaySearch:
    """One search for the shortest way out: `run(matcher, bound)` → the way's ids, or None.

    Args:
        rank: `closing_rank`'s tensor for the tokenizer, `[V]`.
        stop_ids: the end-of-turn ids.
        tail: ids the caller adds itself once the grammar allows them and they complete it
            (nothing to spend on them); empty: the answer ends at the end of turn.
    """

    def __init__(self, rank: torch.Tensor, stop_ids: Sequence[int], tail: Sequence[int] = ()) -> None:
        self.rank = rank
        self.tail = list(tail)
        self.lengths = token_lengths(rank)
        self.stop_ids = list(stop_ids)
        self.vocab = int(rank.numel())
        self.steps = 0
        self.best: list[int] | None = None

    def run(self, matcher: llguidance.LLMatcher, bound: int, *, first: bool = False) -> list[int] | None:
        """The shortest way from `matcher`'s state of at most `bound` tokens (None: none found).

        `first`: stop at the first way that fits `bound` (enough to know a token fits).
        """
        self.steps, self.best = 0, None
        self._walk(matcher.deep_copy(), [], bound, first)
        return self.best

    def _limit(self, bound: int) -> int:
        """The longest way still worth finding: within `bound`, shorter than the best so far."""
        return bound if self.best is None else min(bound, len(self.best) - 1)

    def _walk(self, probe: llguidance.LLMatcher, way: list[int], bound: int, first: bool) -> None:
        while True:
            if probe.is_stopped() or self.tail_completes(probe):
                self.best = list(way)  # within the limit: checked before the last token was added
                return
            if len(way) + 1 > self._limit(bound):
                return
            self.steps += 1
            allowed = allowed_tokens(probe, self.vocab, self.stop_ids)
            choice = closing_choice(allowed, self.rank)  # [V] bool: one token, or every allowed one
            n = int(choice.sum())
            if n == 0:
                return
            if n > 1 and self.steps < SEARCH_STEPS:
                break
            token = self._longest(choice)
            way.append(token)
            if self.rank[token] >= STOP_RANK:
                self.best = list(way)
                return
            if not probe.consume_token(token):
                return
        scores = torch.where(choice, self.lengths[: choice.numel()], torch.tensor(-1.0))
        for token in torch.topk(scores, min(BRANCHES, n)).indices.tolist():
            branch = probe.deep_copy()
            if branch.consume_token(token):
                self._walk(branch, [*way, token], bound, first)
            if first and self.best is not None:
                return

    def tail_completes(self, probe: llguidance.LLMatcher) -> bool:
        """Whether the caller's `tail` is allowed from `probe`'s state and completes the answer."""
        if not self.tail or probe.validate_tokens(self.tail) < len(self.tail):
            return False
        after = probe.deep_copy()
        return bool(after.consume_tokens(self.tail)) and bool(after.is_accepting())

    def replays(self, probe: llguidance.LLMatcher, way: Sequence[int]) -> bool:
        """Whether `way` completes the answer from `probe`'s state (consumes `probe`)."""
        if way and way[-1] in self.stop_ids:
            return bool(probe.consume_tokens(list(way[:-1]))) and bool(probe.is_accepting())
        return bool(probe.consume_tokens(list(way))) and (probe.is_stopped() or self.tail_completes(probe))

    def _longest(self, choice: torch.Tensor) -> int:
        scores = torch.where(choice, self.lengths[: choice.numel()], torch.tensor(-1.0))
        return int(torch.argmax(scores))
