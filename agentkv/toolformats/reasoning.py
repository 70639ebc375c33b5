"""Reasoning blocks (`<think>…</think>`) split off an answer, never read as content or calls.

Qwen3, SmolLM3 and the DeepSeek-R1 distills think inside `<think>` tags before they
answer; a template may open the block in its generation prompt, so the answer can
start inside it (then only the closing tag is in the text).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["THINK", "ReasoningTags", "split_reasoning"]


@dataclass(frozen=True)
class ReasoningTags:
    """The tags around a family's reasoning."""

    open: str = "<think>"
    close: str = "</think>"


THINK = ReasoningTags()


def split_reasoning(
    text: str, tags: ReasoningTags = THINK, *, opened: bool = False
) -> tuple[str | None, str]:
    """`(reasoning, answer)`: the reasoning block's text (None when there is none) and the rest.

    Args:
        text: the answer as generated.
        tags: the family's reasoning tags.
        opened: the generation prompt already opened the block (the text starts inside it).

    An unclosed block (the budget ended it) is all reasoning: the answer is empty.
    """
    head = text.lstrip()
    if head.startswith(tags.open):
        body = head[len(tags.open) :]
    elif opened or (tags.close in text and tags.open not in text):
        body = text
    else:
        return None, text
    end = body.find(tags.close)
    if end < 0:
        return body.strip(), ""
    return body[:end].strip(), body[end + len(tags.close) :].lstrip()
