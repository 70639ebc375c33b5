"""Fixtures for the end-to-end graphs: the examples, loaded from their files, on a tiny backend."""

from __future__ import annotations

import copy
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

from agentkv import AgentKVConfig, TransformersBackend

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str) -> ModuleType:
    """Import `examples/<name>.py` as a module (the examples are scripts, not a package)."""
    module_name = f"agentkv_example_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def long_tiny_model(tiny_model) -> torch.nn.Module:
    """The tiny random Llama with room for long agent histories (its tokenizer is verbose)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = copy.deepcopy(tiny_model.config)
    config.max_position_embeddings = 32768
    model = LlamaForCausalLM(config).eval().to(torch.float32)
    model.requires_grad_(False)
    return model


@pytest.fixture()
def tiny_backend(long_tiny_model, tiny_tokenizer) -> TransformersBackend:
    """A fresh backend (empty session table) over the session-scoped tiny model."""
    return TransformersBackend(long_tiny_model, tiny_tokenizer, AgentKVConfig())


@pytest.fixture()
def example() -> Callable[[str], ModuleType]:
    """`example("tool_assistant")` imports `examples/tool_assistant.py`."""
    return load_example
