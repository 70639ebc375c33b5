"""Recall's word signal: words and codes, weighted by session rarity times the model's surprisal.

A session has a few dozen spans, too few for IDF alone to know that "what" and "should" say
nothing: a question then matches the other questions of the history better than the message
holding its answer. The model's own next-token distribution after a bare newline supplies the
background statistics.
"""

from __future__ import annotations

import torch

from agentkv import AgentKVConfig, TransformersBackend
from agentkv.lifecycle.recall_ranking import rank_for_recall, words
from agentkv.spans import Span, SpanKind, SpanState

QUESTION = "What should I quote as the policy of the pet insurance?"
HISTORY = [
    "What should we do about the invoice? Think it through.",  # shares only the question's form
    "Biscuit is insured with Petshield: the insurance policy is PS-3318-774.",  # the answer
    "What should I bring to the meeting?",  # question form again
    "The car park is closed on Wednesday.",
]
COMMON = {"what": 1.0, "should": 2.0, "i": 1.5, "the": 0.5, "of": 0.7, "as": 1.2, "we": 1.3}
"""Surprisal (nats) of the common words, as a language model would give them; others get 9."""


def spans() -> list[Span]:
    return [
        Span(
            i,
            SpanKind.USER,
            list(range(10 * i, 10 * i + len(text.split()))),
            10 * i,
            state=SpanState.COMMITTED,
        )
        for i, text in enumerate(HISTORY)
    ]


def rank(information):  # noqa: ANN001, ANN201 - a word -> float callable or None
    history = spans()
    ranked = rank_for_recall(
        QUESTION, history, history, text_of=lambda s: HISTORY[s.span_id], information=information
    )
    return [span.span_id for span, score in ranked if score > 0]


def test_words_split_codes_whole_and_by_parts_and_casefold():
    assert words('"Unit_Price": 189.99, ref PS-3318-774') == {
        "unit",
        "price",
        "189.99",
        "189",
        "99",
        "ref",
        "ps-3318-774",
        "ps",
        "3318",
        "774",
    }
    assert "4471" in words("locker KX7-4471") and "4417" not in words("locker KX7-4471")


def test_the_models_surprisal_puts_the_answer_above_questions_of_the_same_form():
    assert rank(None)[0] != 1  # session rarity alone: "what should" outweighs "policy ... insurance"
    assert rank(lambda word: COMMON.get(word, 9.0))[0] == 1


def test_background_logprobs_are_a_distribution_computed_once(tiny_model, tiny_tokenizer):
    session = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig()).session("bg")
    session.extend([{"role": "user", "content": "hello there"}])
    port = session.manager.port
    first = port.background_logprobs()
    assert first.shape == (tiny_model.config.vocab_size,)
    assert torch.allclose(first.exp().sum(), torch.tensor(1.0), atol=1e-4)
    assert port.background_logprobs() is first


def test_the_embedding_signal_builds_no_autograd_graph():
    """A model loaded with trainable weights (`from_pretrained`'s default) ranks without autograd."""
    import warnings

    embed = torch.nn.Embedding(100, 8)
    assert embed.weight.requires_grad
    history = spans()
    memo: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # converting a tensor that requires grad to a float warns
        ranked = rank_for_recall(
            QUESTION,
            history,
            history,
            text_of=lambda s: HISTORY[s.span_id],
            query_ids=list(range(5)),
            embed=embed,
            memo=memo,
        )
    assert ranked and not any(v.requires_grad for v in memo.values() if isinstance(v, torch.Tensor)), (
        "a span's mean embedding is held outside autograd"
    )
