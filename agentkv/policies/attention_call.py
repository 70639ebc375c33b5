"""Route a model's attention calls through a recorder, via transformers' attention interface.

Every transformers decoder hands its attention function (`ALL_ATTENTION_FUNCTIONS`,
looked up by `config._attn_implementation` on each call) the query and key exactly as
the family computed them: after its projections (fused or not), its q/k norms, its
RoPE variant (full, partial, interleaved, none on some layers), with the scaling,
softcap and mask the kernel will use. `routed(model, recorder)` names a wrapper of the
model's own kernel in the config the attention modules read (`"agentkv_probe:sdpa"`,
registered with `AttentionInterface` and, for its mask, `AttentionMaskInterface`): the
wrapper shows each call to `recorder`, then runs the original kernel unchanged, so the
model's outputs are bit-for-bit those of the kernel it was loaded with. On exit every
config gets its kernel back and the registrations are removed when no other model is
routed; nothing of the decode path changes outside the block.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

__all__ = ["PROBE_PREFIX", "AttentionCall", "attention_modules", "routed"]

PROBE_PREFIX = "agentkv_probe:"
"""Prefix of the attention implementation name a routed model runs under (then its own kernel)."""


@dataclass(frozen=True)
class AttentionCall:
    """What one attention layer's kernel received in one forward.

    `query` `[B, H_q, q, D]` and `key` `[B, H_kv, S, D]` are the kernel's own tensors (key
    includes every cached slot); `mask` is the kernel's mask as given (bool: True = attend;
    float: additive; None: causal with the q queries in the last q slots); `sinks` `[H_q]`
    are attention-sink logits that join each row's softmax and take their share (gpt-oss).
    """

    layer: int
    query: torch.Tensor
    key: torch.Tensor
    mask: torch.Tensor | None
    scaling: float
    softcap: float | None
    sinks: torch.Tensor | None = None


class Recorder(Protocol):
    """Receives each attention call of a routed model."""

    def __call__(self, call: AttentionCall) -> None: ...


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The attention modules of a transformers decoder, in layer order.

    An attention module is an `nn.Module` whose class name ends in "Attention" and that has
    an integer `layer_idx` and a `config` (the object whose `_attn_implementation` it reads);
    found anywhere in the model, so wrapped models (PEFT, multimodal text towers) work.

    Raises:
        ValueError: The model has no such module.
    """
    found: list[Any] = [
        m
        for m in model.modules()
        if type(m).__name__.endswith("Attention")
        and isinstance(getattr(m, "layer_idx", None), int)
        and getattr(m, "config", None) is not None
    ]
    if not found:
        msg = (
            f"{type(model).__name__} has no attention module (a `...Attention` module with an integer "
            "`layer_idx` and a `config`); the attention probe supports transformers decoder models"
        )
        raise ValueError(msg)
    return sorted(found, key=lambda m: int(m.layer_idx))


@contextmanager
def routed(model: nn.Module, recorder: Recorder) -> Iterator[list[nn.Module]]:
    """Inside the block, each attention call of `model` is shown to `recorder` first.

    Yields the routed attention modules. Raises RuntimeError when the model is already
    routed (one probe per model at a time) and ValueError when it has no attention module.
    """
    modules = attention_modules(model)
    configs: dict[int, Any] = {id(m.config): m.config for m in modules}
    with _LOCK:
        kernels = {key: _kernel(config) for key, config in configs.items()}
        busy = [k for k in kernels.values() if k.startswith(PROBE_PREFIX)]
        if busy or any(key in _RECORDERS for key in configs):
            msg = (
                f"{type(model).__name__} is already routed through an attention probe ({busy or 'attached'})"
            )
            raise RuntimeError(msg)
        for key, config in configs.items():
            _register(kernels[key])
            _RECORDERS[key] = recorder
            config._attn_implementation_internal = PROBE_PREFIX + kernels[key]
    try:
        yield modules
    finally:
        with _LOCK:
            for key, config in configs.items():
                config._attn_implementation_internal = kernels[key]
                _RECORDERS.pop(key, None)
                _unregister(kernels[key])


def registered_names() -> list[str]:
    """The probe's kernel names registered with transformers now (empty when nothing is routed)."""
    with _LOCK:
        return sorted(PROBE_PREFIX + kernel for kernel in _REFERENCES)


# -- the registry ------------------------------------------------------------------------------

_LOCK = threading.Lock()
_RECORDERS: dict[int, Recorder] = {}
"""id(config) of each routed attention config → its recorder."""
_REFERENCES: dict[str, int] = {}
"""Kernel → how many routed configs use its probe name (registered while > 0)."""


def _kernel(config: Any) -> str:
    return str(getattr(config, "_attn_implementation", None) or "eager")


def _register(kernel: str) -> None:
    count = _REFERENCES.get(kernel, 0)
    _REFERENCES[kernel] = count + 1
    if count:
        return
    name = PROBE_PREFIX + kernel
    AttentionInterface.register(name, _dispatcher(kernel))
    mask = ALL_MASK_ATTENTION_FUNCTIONS.get(kernel)
    if mask is not None:  # no mask function: transformers builds none, for the probe name too
        AttentionMaskInterface.register(name, mask)


def _unregister(kernel: str) -> None:
    count = _REFERENCES.get(kernel, 0) - 1
    if count > 0:
        _REFERENCES[kernel] = count
        return
    _REFERENCES.pop(kernel, None)
    name = PROBE_PREFIX + kernel
    # transformers has no public unregister; its class-wide mappings are plain dicts.
    AttentionInterface._global_mapping.pop(name, None)
    AttentionMaskInterface._global_mapping.pop(name, None)


_WEIGHT_CHANGING = ("position_bias",)
"""Kernel arguments that change attention weights and that the probe does not model."""


def _dispatcher(kernel: str) -> Callable[..., Any]:
    def probe_attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> Any:
        recorder = _RECORDERS.get(id(getattr(module, "config", None)))
        if recorder is not None:
            unsupported = [name for name in _WEIGHT_CHANGING if kwargs.get(name) is not None]
            if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
                unsupported.append(f"a {type(attention_mask).__name__} mask")
            if unsupported:
                msg = f"the attention probe does not model {unsupported} of {type(module).__name__}"
                raise ValueError(msg)
            scaling = kwargs.get("scaling")
            head_dim = int(query.shape[-1])
            recorder(
                AttentionCall(
                    layer=int(getattr(module, "layer_idx", 0)),
                    query=query,
                    key=key,
                    mask=attention_mask,
                    scaling=float(head_dim**-0.5 if scaling is None else scaling),
                    softcap=kwargs.get("softcap"),
                    sinks=kwargs.get("s_aux"),
                )
            )
        return _original(module, kernel)(module, query, key, value, attention_mask, **kwargs)

    return probe_attention


def _original(module: nn.Module, kernel: str) -> Callable[..., Any]:
    """The function the module calls for `kernel` when it is not routed.

    Looked up as its modeling file does: in that file's `ALL_ATTENTION_FUNCTIONS` (a family
    may override a kernel locally), with the file's own eager function as the default.
    """
    interfaces = getattr(sys.modules.get(type(module).__module__), "ALL_ATTENTION_FUNCTIONS", None)
    if not isinstance(interfaces, AttentionInterface):
        interfaces = ALL_ATTENTION_FUNCTIONS
    return interfaces.get_interface(kernel, _family_eager(module))


def _family_eager(module: nn.Module) -> Callable[..., Any]:
    """The eager attention function of the module's own modeling file (softcap, sinks included).

    transformers passes it to `get_interface` as the default for "eager", which a routed
    call no longer sees; every modeling file defines it under this name.
    """
    found = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if not callable(found):
        msg = (
            f"{type(module).__module__} defines no `eager_attention_forward`; "
            f"load {type(module).__name__} with attn_implementation='sdpa' to probe it"
        )
        raise TypeError(msg)
    return found
