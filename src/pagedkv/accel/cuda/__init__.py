"""The CUDA room: Triton kernels that attend over the page pool where its K/V lie.

Nothing here is imported by the reference model or the store; :mod:`.attention_choice`
resolves the runner's ``attention`` option and imports the kernels (and so ``triton``) only
where they are asked for. Without a GPU, the kernels run on CPU tensors under Triton's
interpreter (``TRITON_INTERPRET=1``, set before the kernels' modules are imported), which is
how the tests hold them to the reference attention.
"""
