"""Choosing the next token, and knowing when to stop."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypedDict

import torch

LogitsProcessor = Callable[[Sequence[int], torch.Tensor], torch.Tensor]
"""`(ids generated so far, next-token logits [V]) -> logits [V]`: masks tokens before sampling.

A processor may also have `accept(ids so far, picked id) -> bool`: the decode loop asks it
about each picked token and, on False, calls the processor again for the same position
and picks anew (`pick_token`), so a check too costly to run on every candidate runs on
the picked one only. A processor that refuses must accept after finitely many picks."""


class AnswerOptions(TypedDict, total=False):
    """The keyword options of `Session.generate` (those of `Session.stream`)."""

    temperature: float
    top_p: float
    top_k: int
    stop: Sequence[str] | str | None
    prefix: str
    seed: int | None
    message_id: str | None
    logits_processor: LogitsProcessor | None


@dataclass(frozen=True)
class SamplingParams:
    """How `Session.generate` picks tokens. Greedy unless `temperature > 0`."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    """0 = greedy (argmax)."""
    top_p: float = 1.0
    top_k: int = 0
    """0 = no top-k filter."""
    stop: tuple[str, ...] = ()
    """Strings that end the answer; the answer returned excludes them."""
    seed: int | None = None
    logits_processor: LogitsProcessor | None = None
    """Called on the logits before each token is picked (e.g. to forbid a tool-call tag)."""

    @classmethod
    def from_options(
        cls, max_new_tokens: int, options: AnswerOptions
    ) -> tuple[SamplingParams, str, str | None]:
        """`(params, prefix, message_id)` from `Session.stream`'s options, checked with clear errors.

        The one place the answer options become sampling parameters, for every session kind.
        """
        unknown = sorted(set(options) - set(AnswerOptions.__annotations__))
        if unknown:
            msg = f"unknown answer option(s) {unknown}; allowed: {', '.join(AnswerOptions.__annotations__)}"
            raise TypeError(msg)
        stop = options.get("stop")
        if stop is not None and not isinstance(stop, str | Sequence):
            msg = f"stop: expected a string or a list of strings, got {type(stop).__name__}"
            raise TypeError(msg)
        prefix, message_id = options.get("prefix"), options.get("message_id")
        for name, value in (("prefix", prefix), ("message_id", message_id)):
            if value is not None and not isinstance(value, str):
                msg = f"{name}: expected a string, got {type(value).__name__} {value!r:.40}"
                raise TypeError(msg)
        params = cls(
            max_new_tokens=max_new_tokens,
            temperature=options.get("temperature", 0.0),
            top_p=options.get("top_p", 1.0),
            top_k=options.get("top_k", 0),
            stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
            seed=options.get("seed"),
            logits_processor=options.get("logits_processor"),
        )
        return params, prefix or "", message_id

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            msg = f"max_new_tokens: must be an int >= 1, got {self.max_new_tokens!r}"
            raise ValueError(msg)
        if self.temperature < 0:
            msg = f"temperature: must be >= 0, got {self.temperature}"
            raise ValueError(msg)
        if not 0 < self.top_p <= 1:
            msg = f"top_p: must be in (0, 1], got {self.top_p}"
            raise ValueError(msg)
        if self.top_k < 0:
            msg = f"top_k: must be >= 0, got {self.top_k}"
            raise ValueError(msg)
        if any(not isinstance(s, str) or not s for s in self.stop):
            msg = f"stop: must be non-empty strings, got {self.stop!r}"
            raise ValueError(msg)


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token id from `logits: [V]`."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    scores = logits.float() / params.temperature  # [V]
    if params.top_k:
        kth = torch.topk(scores, min(params.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(-1)
        drop_sorted = (
            cumulative - torch.softmax(sorted_scores, dim=-1) > params.top_p
        )  # keep the first over p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def pick_token(
    logits: torch.Tensor, produced: Sequence[int], params: SamplingParams, generator: torch.Generator | None
) -> int:
    """The next token id after `produced`, from `logits: [V]` through the answer's processor (if any)."""
    processor = params.logits_processor
    if processor is None:
        return sample_next(logits.cpu(), params, generator)
    accept = getattr(processor, "accept", None)
    while True:
        token = sample_next(processor(produced, logits).cpu(), params, generator)
        if accept is None or accept(produced, token):
            return token


class StopMatcher:
    """Finds stop strings in streamed text and holds back text that may start one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.longest = max((len(s) for s in self.stops), default=0)

    def find(self, text: str) -> int | None:
        """Index where the earliest stop string starts in `text`, or None."""
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def safe_length(self, text: str) -> int:
        """How much of `text` can be emitted without risking a later stop match."""
        for keep in range(min(self.longest - 1, len(text)), 0, -1):
            tail = text[-keep:]
            if any(s.startswith(tail) for s in self.stops):
                return len(text) - keep
        return len(text)
