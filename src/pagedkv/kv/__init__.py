"""Reference KV cache: the KVManager (pages, prefix index, eviction) and the PagedStore.

Importing this package must not import torch (KVM-040); the PagedStore lives in its own module.
"""

from pagedkv.kv.manager import ReferenceKVManager

__all__ = ["ReferenceKVManager"]
