"""The PagedStore: K/V tensors in pages, written and read for attention by a step's plan.

It never decides which pages a sequence owns (that is the KVManager's, in the torch-free
:mod:`pagedkv.kv`); it takes page ids and slots as given.
"""
