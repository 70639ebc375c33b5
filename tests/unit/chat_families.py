"""Tiny tokenizers with each fixture family's special tokens and chat template (test helper).

The templates are the published ones (tests/fixtures/chat_templates, sources in its
SOURCES.md); each tokenizer is the tiny in-process BPE of `tests/conftest.py` with the
family's bos / eos / turn tokens added, so rendering, splitting, grammars and parsing
see the family's real special tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"


@dataclass(frozen=True)
class Family:
    """One chat-template family: its fixture and its tokens."""

    name: str
    template: str
    bos: str | None
    eos: str
    specials: tuple[str, ...]
    plain: tuple[str, ...] = ()
    """Added tokens that the family's tokenizer does not mark special (Qwen's `<tool_call>`)."""
    tool_format: str = "hermes"
    """The format `detect_tool_format` must find."""
    reasoning: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)


FAMILIES = (
    Family(
        "llama3.1",
        "meta-llama-Llama-3.3-70B-Instruct.jinja",
        "<|begin_of_text|>",
        "<|eot_id|>",
        ("<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"),
        tool_format="llama3_json",
    ),
    Family(
        "llama3.2",
        "meta-llama-Llama-3.2-3B-Instruct.jinja",
        "<|begin_of_text|>",
        "<|eot_id|>",
        ("<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"),
        tool_format="llama3_json",
    ),
    Family(
        "qwen3",
        "Qwen-Qwen3-0.6B.jinja",
        None,
        "<|im_end|>",
        ("<|im_start|>",),
        plain=("<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"),
        tool_format="qwen",
        reasoning=True,
    ),
    Family(
        "mistral-nemo",
        "mistralai-Mistral-Nemo-Instruct-2407.jinja",
        "<s>",
        "</s>",
        (
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ),
        tool_format="mistral",
    ),
    Family("gemma2", "google-gemma-2-2b-it.jinja", "<bos>", "<eos>", ("<start_of_turn>", "<end_of_turn>")),
    Family(
        "phi3.5",
        "microsoft-Phi-3.5-mini-instruct.jinja",
        "<s>",
        "<|endoftext|>",
        ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
    ),
    Family(
        "phi4-mini",
        "llama-cpp-microsoft-Phi-4-mini-instruct.jinja",
        None,
        "<|endoftext|>",
        (
            "<|system|>",
            "<|user|>",
            "<|assistant|>",
            "<|end|>",
            "<|tool|>",
            "<|/tool|>",
            "<|tool_call|>",
            "<|/tool_call|>",
            "<|tool_response|>",
        ),
        tool_format="phi4",
    ),
    Family(
        "granite3.3",
        "ibm-granite-granite-3.3-2B-Instruct.jinja",
        None,
        "<|end_of_text|>",
        ("<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"),
        tool_format="granite",
        reasoning=True,
    ),
    Family(
        "smollm3",
        "HuggingFaceTB-SmolLM3-3B.jinja",
        None,
        "<|im_end|>",
        ("<|im_start|>",),
        plain=("<think>", "</think>"),
        reasoning=True,
    ),
    Family(
        "deepseek-r1",
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        (
            "<｜User｜>",
            "<｜Assistant｜>",
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁calls▁end｜>",
            "<｜tool▁call▁begin｜>",
            "<｜tool▁call▁end｜>",
            "<｜tool▁sep｜>",
            "<｜tool▁outputs▁begin｜>",
            "<｜tool▁outputs▁end｜>",
            "<｜tool▁output▁begin｜>",
            "<｜tool▁output▁end｜>",
        ),
        plain=("<think>", "</think>"),
        reasoning=True,
    ),
)


def family_tokenizer(family: Family) -> Any:
    """The tiny BPE tokenizer with `family`'s tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    base = ["<pad>", *([family.bos] if family.bos else []), family.eos]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=base, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = [
        "the user asked about the weather in Paris and the tool returned sunny skies",
        "system you are a helpful assistant user assistant tool result code number",
        'call the function {"name": "get_weather", "arguments": {"city": "Paris"}} parameters',
    ] * 20
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=family.bos,
        eos_token=family.eos,
        pad_token="<pad>",
        additional_special_tokens=list(family.specials),
    )
    if family.plain:
        fast.add_tokens(list(family.plain), special_tokens=False)
    fast.chat_template = (FIXTURES / family.template).read_text(encoding="utf-8")
    return fast
