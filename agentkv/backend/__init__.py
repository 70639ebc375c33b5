"""Backends run the model; the Transformers in-process backend is the first."""

from agentkv.backend.runner import Feed, ModelRunner
from agentkv.backend.sampling import SamplingParams
from agentkv.backend.transformers import TransformersBackend, UnknownSessionError

__all__ = ["Feed", "ModelRunner", "SamplingParams", "TransformersBackend", "UnknownSessionError"]
