"""A model's state dict in the form safetensors accepts and `from_pretrained` expects."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

__all__ = ["serializable_state_dict", "tied_output_keys"]


def serializable_state_dict(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The state dict in the form safetensors accepts and `from_pretrained` expects.

    safetensors refuses tensors that share memory. A tied output embedding is
    dropped (`from_pretrained` re-ties it from the config); any other shared tensor
    is cloned so each name owns its storage.
    """
    tied = tied_output_keys(model)
    seen: set[int] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name in tied:
            continue
        tensor = tensor.detach()
        storage = tensor.untyped_storage().data_ptr()
        tensor = tensor.clone() if storage in seen else tensor
        seen.add(storage)
        tensors[name] = tensor.contiguous()
    return tensors


def tied_output_keys(model: PreTrainedModel) -> set[str]:
    """State-dict names of the output embedding when it is tied to (shares storage with) the input one."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return set()
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if inputs is None or outputs is None:
        return set()
    in_weight, out_weight = getattr(inputs, "weight", None), getattr(outputs, "weight", None)
    if not isinstance(in_weight, torch.Tensor) or not isinstance(out_weight, torch.Tensor):
        return set()
    if in_weight.data_ptr() != out_weight.data_ptr():
        return set()
    return {f"{name}.weight" for name, module in model.named_modules() if module is outputs}
