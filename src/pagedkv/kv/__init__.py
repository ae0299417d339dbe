"""Reference KV cache manager: pages, reference counts, the prefix index and eviction.

No module of this package imports torch (KVM-040): the PagedStore, which holds the tensors,
is :mod:`pagedkv.store`.
"""

from pagedkv.kv.manager import ReferenceKVManager

__all__ = ["ReferenceKVManager"]
