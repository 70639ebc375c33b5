"""The token loop of an answer: sample, stop, and hand out text as soon as it is safe to show.

Kept apart from the session (as gpt-fast keeps `decode_n_tokens` apart from the
model): the session owns the span the answer becomes and feeds each produced
token back through `step`; this module only turns logits into tokens and tokens
into text pieces.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from agentkv.backend.sampling import SamplingParams, StopMatcher, pick_token


def answer_logprob(first: torch.Tensor, logits: torch.Tensor, prompt: list[int], target: list[int]) -> float:
    """Log-probability of `target` after `prompt`, teacher-forced.

    Args:
        first: `[V]` logits before the prompt's first token (the cache's last logits).
        logits: `[n, V]` logits after each of the `n = len(prompt) + len(target)` tokens.
        prompt: the generation prompt's ids (not scored).
        target: the answer's ids.
    """
    rows = torch.cat([first[None], logits[:-1]])  # [n, V]: row i predicts token i
    logprobs = torch.log_softmax(rows.float(), dim=-1)
    ids = torch.tensor(prompt + target)
    picked = logprobs[torch.arange(len(ids)), ids]
    return float(picked[len(prompt) :].sum())


@dataclass
class Answer:
    """What the loop produced so far (read after it ends, even when it ended by an error)."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    """The decoded text, cut at a stop string."""
    kept: int | None = None
    """After a stop string: how many of `tokens` the cut text starts with (the rest spell the
    stop string, and perhaps a token's start before it); None: every token is the answer's."""
    tail: str = ""
    """After a stop string: the cut text's end that the kept tokens do not spell (the start of
    the token the stop string begins inside; usually empty)."""


def decode_answer(
    logits: torch.Tensor,
    step: Callable[[int], torch.Tensor],
    params: SamplingParams,
    tokenizer: Any,
    stop_ids: Container[int],
    answer: Answer,
    hidden: Container[int] | None = None,
) -> Iterator[str]:
    """Yield the answer's text in pieces, calling `step(token)` for the next logits `[V]`.

    Ends at a stop token (not kept), a stop string (cut off), or `max_new_tokens`.
    Special tokens are left out of the text, except those not in `hidden` when it is
    given (a tool-call format's `[TOOL_CALLS]`, a reasoning tag: the parser reads them).
    The last produced token is not fed back (nothing needs its logits); the
    caller encodes it with the end-of-turn ids.
    """
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device="cpu").manual_seed(params.seed)
    matcher = StopMatcher(params.stop)
    emitted = 0
    finished_by_stop_string = False

    def decode(tokens: list[int]) -> str:
        if hidden is None:
            return str(tokenizer.decode(tokens, skip_special_tokens=True))
        return str(tokenizer.decode([t for t in tokens if t not in hidden], skip_special_tokens=False))

    for _ in range(params.max_new_tokens):
        token = pick_token(logits, answer.tokens, params, generator)
        if token in stop_ids:
            break
        answer.tokens.append(token)
        text = decode(answer.tokens)
        cut = matcher.find(text)
        if cut is not None:
            text = text[:cut]
            finished_by_stop_string = True
            answer.kept, answer.tail = kept_tokens(answer.tokens, text, decode)
        answer.text = text
        safe = len(text) if finished_by_stop_string else matcher.safe_length(text)
        # Byte-level BPE may end mid-character: hold back a trailing replacement char.
        while safe > emitted and text[safe - 1] == "\ufffd" and not finished_by_stop_string:
            safe -= 1
        if safe > emitted:
            yield text[emitted:safe]
            emitted = safe
        if finished_by_stop_string or len(answer.tokens) >= params.max_new_tokens:
            break
        logits = step(token)
    if emitted < len(answer.text):
        yield answer.text[emitted:]


def kept_tokens(tokens: Sequence[int], text: str, decode: Callable[[list[int]], str]) -> tuple[int, str]:
    """How many leading `tokens` spell a prefix of `text` (an answer cut at a stop string); the rest of it.

    The stop string's own tokens are not the answer's: a history that held them would say
    more than the message it stands for.
    """
    ids = list(tokens)
    kept = len(ids)
    while kept and not text.startswith(decode(ids[:kept])):
        kept -= 1
    spelled = decode(ids[:kept]) if kept else ""
    return kept, text[len(spelled) :]
