"""Shared fixtures: a tiny random Llama built in-process (no download) and a tokenizer for it."""

from __future__ import annotations

import os

# Spin-waiting OpenMP threads make torch ~10x slower when other processes share the 2 CPU cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def tiny_llama_config(**overrides: object):  # noqa: ANN201 - transformers config
    from transformers import LlamaConfig

    values: dict[str, object] = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    values.update(overrides)
    return LlamaConfig(**values)


@pytest.fixture(scope="session")
def tiny_model() -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = tiny_llama_config()
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval().to(torch.float32)
    model.requires_grad_(False)
    return model


def build_tiny_tokenizer():  # noqa: ANN201 - a PreTrainedTokenizerFast
    """A byte-level BPE tokenizer trained in-process on a small corpus, with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "<|im_end|>", "<|im_start|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = [
        "the user asked about the weather in Paris and the tool returned sunny skies",
        "system you are a helpful assistant user assistant tool result code number",
        "The secret code is 4417. Remember the package tracking number ZX-99.",
        "search results: lorem ipsum dolor sit amet, consectetur adipiscing elit 0123456789",
    ] * 20
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
        additional_special_tokens=["<|im_start|>"],
    )
    from agentkv.chat import FALLBACK_CHAT_TEMPLATE

    fast.chat_template = FALLBACK_CHAT_TEMPLATE
    assert fast.convert_tokens_to_ids("<|im_end|>") == 2
    return fast


@pytest.fixture(scope="session")
def tiny_tokenizer():  # noqa: ANN201 - a PreTrainedTokenizerFast
    """The tiny tokenizer (`build_tiny_tokenizer`), once per test session."""
    return build_tiny_tokenizer()
