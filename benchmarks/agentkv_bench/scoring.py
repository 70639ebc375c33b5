"""How the memory bench scores an answer: normalising, exact match, KL, teacher-forced log-probs.

Pure functions of text and tensors, no session: `agentkv_bench.memory` replays the
workloads and calls these on what the model answered.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "answer_text",
    "decided",
    "exact_match",
    "gold_logprob",
    "kl_divergence",
    "normalise_answer",
    "overhead_seconds",
]

# -- metrics ------------------------------------------------------------------------------------

_WORD = re.compile(r"[^\W_]+")


def normalise_answer(text: str) -> str:
    """Casefolded alphanumeric words joined by single spaces (NFKC first).

    Punctuation and spacing differences ("KX7-4471." vs "kx7 4471") are not what
    the benchmark measures; which characters and digits the model copied is.
    """
    return " ".join(_WORD.findall(unicodedata.normalize("NFKC", text).casefold()))


def exact_match(answer: str, gold: str) -> bool:
    """Whether the greedy continuation *starts with* the gold answer, word-aligned, after normalising.

    The answer is the text generated after the completion prefix ("The booking code
    is"), so a correct answer begins with the fact: `" KX7-4471."` matches gold
    `"KX7-4471"`, `" KX7-4471 and"` matches too, `" KX7-44712"` (a different
    number) and `" the code KX7-4471"` (not where the fact belongs) do not.
    """
    a, g = normalise_answer(answer), normalise_answer(gold)
    if not g:
        return False
    return a == g or a.startswith(g + " ")


def kl_divergence(reference_logprobs: torch.Tensor, logprobs: torch.Tensor) -> float:
    """KL(reference ‖ other) in nats, from two `[V]` log-probability vectors."""
    p = reference_logprobs.double()
    q = logprobs.double()
    return float((p.exp() * (p - q)).sum().clamp_min(0.0))


def gold_logprob(logits: torch.Tensor, prompt_len: int, target: Sequence[int]) -> tuple[float, torch.Tensor]:
    """Teacher-forced log-prob of `target` and the log-distribution of its first token.

    Args:
        logits: `[prompt_len + len(target), V]` rows of `Session.continuation_logits(prompt + target)`;
            row i is the distribution after token i.
        prompt_len: tokens of the generation prompt plus the completion prefix (>= 1).
        target: token ids of the gold answer.

    Returns:
        (sum of log-probs of the target tokens, `[V]` log-probs at the answer position).
    """
    if prompt_len < 1:
        msg = f"prompt_len must be >= 1 (the answer position follows the prompt), got {prompt_len}"
        raise ValueError(msg)
    rows = torch.log_softmax(logits[prompt_len - 1 : prompt_len - 1 + len(target)].float(), dim=-1)  # [T, V]
    picked = rows[torch.arange(len(target)), torch.tensor(list(target), dtype=torch.long)]
    return float(picked.sum()), rows[0]


def overhead_seconds(stats: Any) -> float:
    """Time in lifecycle + policy + store, from `SessionStats`.

    `LifecycleManager._timed` sections nest (a budget check inside
    `lifecycle_seconds` moves spans inside `store_seconds`, which may score them
    inside `policy_seconds`); the manager charges each section only its own time
    (nested sections and model forwards excluded), so the three add up without
    double counting.
    """
    return float(stats.lifecycle_seconds + stats.policy_seconds + stats.store_seconds)


def answer_text(prefix: str, gold: str) -> str:
    """How the gold answer continues `prefix`: after a space, unless the prefix ends in one.

    Prefixes that end inside a token (an opening quote, `C-`, `Binomial(`) are continued
    directly, so the teacher-forced target is tokenised the way the model writes it.
    """
    return gold if not prefix or prefix[-1] in _GLUED else " " + gold


_GLUED = frozenset(" \t\n\"'([{-/")


def decided(answer: str, gold: str) -> bool:
    """Whether more greedy tokens can no longer change `exact_match(answer, gold)`.

    Decoding stops there: a correct answer needs the gold's words plus one more
    word or the end, a wrong one is wrong from its first diverging character.
    """
    a, g = normalise_answer(answer), normalise_answer(gold)
    if a.startswith(g + " "):
        return True
    return not (g.startswith(a) or a.startswith(g))
