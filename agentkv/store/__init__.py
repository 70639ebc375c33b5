"""Where KV lives: the attended physical cache and the archive tiers beside it."""

from agentkv.store.block import KVBlock, tensor_bytes
from agentkv.store.cache import ManagedCache, PhysicalCache, SharedPrefixLayer
from agentkv.store.host import HostBlock, HostMemoryError
from agentkv.store.kvstore import KVStore
from agentkv.store.protocol import ARCHIVE_TIERS, KVStoreProtocol, TierBytes
from agentkv.store.quantized import QuantizedBlock, QuantizedTensor, quantize_keys, quantize_values

__all__ = [
    "ARCHIVE_TIERS",
    "HostBlock",
    "HostMemoryError",
    "KVBlock",
    "KVStore",
    "KVStoreProtocol",
    "ManagedCache",
    "PhysicalCache",
    "QuantizedBlock",
    "QuantizedTensor",
    "SharedPrefixLayer",
    "TierBytes",
    "quantize_keys",
    "quantize_values",
    "tensor_bytes",
]
