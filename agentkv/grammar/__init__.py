"""Grammar-constrained decoding: tool calls and structured output that always parse.

A grammar (a JSON schema, or a Lark grammar built from the bound tools) is compiled
once per tokenizer and grammar text (`compiled.compile_grammar`); each answer gets a
`GrammarProcessor`, a logits processor for the session's decode loop that advances
the grammar by every produced token and masks the tokens it does not allow. Once the
grammar is complete only the end-of-turn token is allowed, so the answer stops there.
The library underneath is llguidance (measured against xgrammar by
`scripts/grammar_libraries.py`, see docs/benchmarks.md).
"""

from agentkv.grammar.compiled import CompiledGrammar, compile_grammar
from agentkv.grammar.finishing import AnswerTooLong, BudgetCut
from agentkv.grammar.grammars import (
    GrammarError,
    json_grammar,
    strict_schema,
    text_grammar,
    text_or_call_grammar,
    tool_call_grammar,
)
from agentkv.grammar.processor import GrammarProcessor
from agentkv.grammar.tokenizer import grammar_tokenizer

__all__ = [
    "AnswerTooLong",
    "BudgetCut",
    "CompiledGrammar",
    "GrammarError",
    "GrammarProcessor",
    "compile_grammar",
    "grammar_tokenizer",
    "json_grammar",
    "strict_schema",
    "text_grammar",
    "text_or_call_grammar",
    "tool_call_grammar",
]
