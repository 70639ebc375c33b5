"""Where each message's text lies in a rendered conversation, found by comparing renderings.

Nothing here relies on a marker surviving the template (`| trim` eats whitespace
markers, some templates rewrite content): message i's text is what the rendering of
the first i+1 messages adds to the rendering of the first i, compared character by
character with the rendering of the whole conversation. A template that rewrites
earlier text when a message is added (a "last message" special case, reasoning
dropped from older turns) still splits: the rewritten part is attributed to the
later message, and the concatenation is always the whole rendering.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["Cached", "Split", "clean_cut", "common_prefix", "safe_cut", "split_history"]


def common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of `a` and `b`."""
    limit = min(len(a), len(b))
    if a[:limit] == b[:limit]:
        return limit
    lo, hi = 0, limit  # invariant: a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def safe_cut(text: str, at: int, specials: Sequence[str]) -> int:
    """`at`, moved back to the start of a special token that it would cut in two."""
    for token in specials:
        for back in range(1, len(token)):
            start = at - back
            if start >= 0 and text.startswith(token, start) and start + len(token) > at:
                return safe_cut(text, start, specials)
    return at


@dataclass(frozen=True)
class Cached:
    """What a held message's span says about its text."""

    text: str | None
    """The text its tokens stand for (None: unknown, so it is not held as it is)."""
    produced: bool = False
    """The text is what the model produced; the template has not rendered the message yet."""


@dataclass
class Split:
    """The result of `split_history`."""

    kept: int
    """How many held messages still render as held (their spans stay)."""
    texts: list[str]
    """The texts of the messages after them, in order."""
    learned: dict[int, str] = field(default_factory=dict)
    """Held answers whose rendering was seen for the first time: index → the template's text."""


def split_history(
    history: Callable[[int], str],
    count: int,
    cached: Sequence[Cached],
    specials: Sequence[str],
    accept: Callable[[str, str], bool] = lambda produced, rendered: True,
) -> Split:
    """How many held messages still render as held, and the texts of the messages after them.

    Args:
        history: `history(i)` is the rendering of the first `i` messages (raises when the
            template cannot render them alone; that boundary then joins the next message).
        count: how many messages there are.
        cached: what the spans of the first messages hold (see `Cached`).
        specials: the tokenizer's special tokens, never cut in two.
        accept: `(produced, rendered)`: whether an answer whose produced text differs from
            the template's rendering of it keeps its produced tokens (their text says the
            same: a call written with other spacing, content the template trims); else it
            is re-encoded as rendered.

    The kept texts (learned ones as learned) followed by `texts` are exactly `history(count)`.
    """
    full = history(count)
    at = 0
    kept = 0
    learned: dict[int, str] = {}
    for index, held in enumerate(cached):
        if held.text is None:
            break
        if held.produced:
            end = _boundary(history, index + 1, count, full, at, specials)
            rendered = full[at:end]
            if rendered != held.text:
                if not accept(held.text, rendered):
                    break
                learned[index] = rendered
            at = end
        elif full.startswith(held.text, at):
            at += len(held.text)
        else:
            break
        kept += 1
    texts: list[str] = []
    for i in range(kept + 1, count):
        end = _boundary(history, i, count, full, at, specials)
        texts.append(full[at:end])
        at = end
    if kept < count:
        texts.append(full[at:])
    return Split(kept, texts, learned)


def _boundary(
    history: Callable[[int], str], i: int, count: int, full: str, at: int, specials: Sequence[str]
) -> int:
    """Where the first `i` messages end in `full` (not before `at`).

    Where the rendering of the first `i` messages is not a prefix of `full` (the template
    renders the last of them its own way), the cut goes back to the last line end or
    special token before the difference, so no token is cut in two.
    """
    if i >= count:
        return len(full)
    try:
        prefix = history(i)
    except Exception:  # noqa: BLE001 - the template cannot render this prefix alone
        prefix = ""
    common = common_prefix(prefix, full)
    if common < len(prefix):
        common = clean_cut(full, at, common, specials)
    return max(at, safe_cut(full, common, specials))


def clean_cut(text: str, start: int, at: int, specials: Sequence[str]) -> int:
    """The last line end or special-token end in `text[start:at]` (`start` when there is none)."""
    best = text.rfind("\n", start, at) + 1
    for token in specials:
        found = text.rfind(token, start, at)
        if found >= 0 and found + len(token) <= at:
            best = max(best, found + len(token))
    return max(best, start)
