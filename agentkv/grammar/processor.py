"""The logits processor that keeps an answer inside a grammar, token by token."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import llguidance
import torch

from agentkv.grammar.compiled import CompiledGrammar
from agentkv.grammar.finishing import (
    CLOSING_WINDOW,
    RECHECK_AFTER,
    REJECTIONS,
    AnswerTooLong,
    BudgetCut,
    closing_choice,
    closing_rank,
)
from agentkv.grammar.way_out import WaySearch, allowed_tokens


class GrammarProcessor:
    """Masks the tokens a grammar does not allow next; a `LogitsProcessor` for `Session.generate`.

    Each call first advances the grammar by the tokens produced since the last call,
    then sets every disallowed token's logit to -inf. Once the grammar is complete
    only its stop tokens (the end of turn) remain, so the decode loop ends there.

    With a `budget`, the answer also ends inside it, so `max_new_tokens` never cuts a
    call or a JSON value in the middle (`agentkv.grammar.finishing`):
    - a budget the grammar's shortest answer cannot fit is refused at construction
      (`AnswerTooLong`, before anything is decoded);
    - in the last `window` tokens of the budget the processor holds a way out (the
      ids of a complete ending, `agentkv.grammar.way_out`) that fits the budget left,
      and the decode loop asks `accept` about each picked token: one after which no
      way out fits (one more array item opened too late) is refused, and masked when
      the loop calls again for the same position. The check runs on the picked
      token only, not on every candidate;
    - when the budget left is down to the way out, only closing tokens remain, and
      after `REJECTIONS` refusals at one position only the way out's next token;
      text that could end where a token was refused (a call's opening with too few
      tokens left) ends there.
    The first token the budget kept the model from is held as `cut` (a `BudgetCut`), so
    the caller can tell the user the answer ended early and how much budget it needed.

    Args:
        compiled: the grammar (`compile_grammar`); this answer gets its own matcher.
        prefix_ids: the ids of text the answer starts with that was prefilled, not
            generated (a call's opening): the grammar is advanced through them first.
        budget: the answer's `max_new_tokens` (None: no finishing).
        tokenizer: the Hugging Face tokenizer (needed with `budget`, to rank closing tokens).
        stop_ids: the end-of-turn ids: allowed only once the grammar may end (and
            ranked for closing with `budget`).
        tail_ids: ids the caller adds itself once the grammar reaches them, so the budget
            need not hold them (a forced call's close tag: the caller stops decoding when
            the call's JSON closes).

    Raises:
        AnswerTooLong: (a `ValueError`) the shortest answer found takes more than `budget` tokens.
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
        tail_ids: Sequence[int] = (),
    ) -> None:
        self.compiled = compiled
        self.matcher = compiled.matcher()
        self.consumed = 0
        self.mask_calls = 0
        self.searches = 0
        """Searches for a way out run so far (the cost of finishing)."""
        self.budget = budget
        self.finishing = False
        """True once the budget left is what the way out needs."""
        self.next_check = 0
        self.stop_ids = sorted(set(stop_ids))
        """End-of-turn ids: allowed only where the grammar may end (whatever the tokenizer marks special)."""
        self.rank = closing_rank(tokenizer, set(self.stop_ids)) if budget is not None else None
        self.search = WaySearch(self.rank, self.stop_ids, tail_ids) if self.rank is not None else None
        self.window = CLOSING_WINDOW
        """Tokens before the end of the budget from which picked tokens are checked."""
        self.way: list[int] | None = None
        """A way out (ids, the end of turn last) from the state after `way_at` tokens; None: unknown."""
        self.way_at = -1
        self.refused: set[int] = set()
        """Tokens `accept` refused at the current position (masked by the next call)."""
        self.cut: BudgetCut | None = None
        """Where the budget first kept the model from its token (None: it never did)."""
        if prefix_ids and not self.matcher.consume_tokens(list(prefix_ids)):
            self._fail("the prefilled prefix")
        if budget is not None:
            self._check_budget(budget)

    def _check_budget(self, budget: int) -> None:
        """Refuse a budget under the shortest answer; widen the window to twice that answer."""
        way = self._search(self.matcher, budget)
        if way is None:
            longer = self._search(self.matcher, 4 * budget + CLOSING_WINDOW)
            if longer is not None:
                raise AnswerTooLong(len(longer), budget)
            return  # no way out by closing tokens (free text): nothing to promise
        self.window = max(CLOSING_WINDOW, 2 * len(way))
        self.way, self.way_at = way, 0

    def __call__(self, produced: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """Logits `[V]` with the tokens the grammar forbids next at -inf."""
        new = list(produced[self.consumed :])
        if new and not self.matcher.consume_tokens(new):
            self._fail(f"generated token(s) {new}")
        if new:
            self.refused.clear()
        self.consumed = len(produced)
        allowed = self.allowed(logits.shape[-1])
        self.mask_calls += 1
        if self.rank is not None and self.budget is not None:
            left = self.budget - len(produced)
            if not self.finishing and left <= self.window and len(produced) >= self.next_check:
                way = self._way_here(len(produced), left)
                self.finishing = way is not None and len(way) >= left
                # No way out found (free text before a call): look again a few tokens later.
                self.next_check = len(produced) + (RECHECK_AFTER if way is None else 0)
            if self.refused:
                kept = allowed.clone()
                kept[[i for i in self.refused if i < allowed.numel()]] = False
                # Refusals are a preference within the grammar: never mask every token it allows.
                allowed = kept if bool(kept.any()) else allowed
            way = self.way if self.way_at == len(produced) else None
            if len(self.refused) >= REJECTIONS and way:  # the way out itself, which fits
                allowed = torch.zeros_like(allowed)
                allowed[way[0]] = True
            elif self.finishing:
                closing = closing_choice(allowed, self.rank)
                if self.cut is None:
                    preferred = int(
                        torch.argmax(logits.masked_fill(~allowed.to(logits.device), float("-inf")))
                    )
                    if not bool(closing[preferred]):
                        self._note_cut(len(produced), preferred)
                allowed = closing
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

    def accept(self, produced: Sequence[int], token: int) -> bool:
        """Whether `token`, picked after `produced`, still leaves a way out within the budget.

        True outside the budget's last `window` tokens and for the end of turn. A refused
        token is remembered: the next call for the same position masks it (the decode
        loop calls again and picks anew).
        """
        if self.budget is None or token in self.stop_ids:
            return True
        position, left = len(produced), self.budget - len(produced)
        if left > self.window or len(self.refused) > REJECTIONS:
            return True
        way = self.way if self.way_at == position else None
        if way and token == way[0]:
            self.way, self.way_at = way[1:], position + 1
            return True
        probe = self.matcher.deep_copy()
        if not probe.consume_token(token):
            return True  # outside the grammar: `__call__` reports it with the ids
        fits = way is not None and len(way) <= left - 1
        if fits and way and self.search is not None and self.search.replays(probe.deep_copy(), way):
            self.way_at = position + 1  # the same way out (a token inside a string, say)
            return True
        found = self._search(probe, left - 1, first=True)
        if found is not None:
            self.way, self.way_at = found, position + 1
            return True
        self.refused.add(token)
        self._note_cut(position, token)
        if way is not None and len(way) == 1 and way[0] in self.stop_ids:
            # Text turned away from a call it has no room for ends here, not in a pseudo-call.
            self.finishing = True
        return False

    def _note_cut(self, position: int, token: int) -> None:
        """Hold the first token the budget kept the model from, with the budget it needed.

        A token that would have fit after all (finishing picked another closer of the
        same way out) is no cut; the wider search for what a cut needs runs once.
        """
        if self.cut is not None or self.budget is None:
            return
        probe = self.matcher.deep_copy()
        if not probe.consume_token(token) or probe.is_stopped():
            return  # outside the grammar (`__call__` reports it), or the end: never a cut
        if self._search(probe, self.budget - position - 1, first=True) is not None:
            return
        way = self._search(probe, 4 * self.budget + CLOSING_WINDOW)
        self.cut = BudgetCut(position, token, None if way is None else position + 1 + len(way))

    def _way_here(self, position: int, left: int) -> list[int] | None:
        """A way out from the current state: the one held for `position`, else searched."""
        if self.way_at == position and self.way is not None:
            return self.way
        way = self._search(self.matcher, left)
        if way is not None:
            self.way, self.way_at = way, position
        return way

    def _search(self, matcher: llguidance.LLMatcher, bound: int, *, first: bool = False) -> list[int] | None:
        if self.search is None:
            return None
        self.searches += 1
        return self.search.run(matcher, bound, first=first)

    def allowed(self, vocab: int) -> torch.Tensor:
        """Which of `vocab` token ids the grammar allows next, `[vocab]` bool (ids past the tokenizer: no)."""
        allowed = allowed_tokens(self.matcher, vocab, self.stop_ids)
        if self.matcher.is_error():
            self._fail("the mask")
        return allowed

    @property
    def complete(self) -> bool:
        """Whether what was produced so far is a full sentence of the grammar."""
        return bool(self.matcher.is_accepting())

    def _fail(self, what: str) -> None:
        msg = f"constrained decoding: {what} left the grammar: {self.matcher.get_error()}"
        raise RuntimeError(msg)
