"""The CUDA room: Triton kernels that attend over the page pool where its K/V lie, and the
fused position-wise ops of the layers (norms with their residual add or rotation, the SwiGLU
activation) substituted for the reference modules.

Nothing here is imported by the reference model or the store; :mod:`.attention_choice` and
:mod:`.fused_choice` resolve the runner's ``attention`` and ``fused_ops`` options and import
the kernels (and so ``triton``) only where they are asked for. Without a GPU, the kernels run
on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, set before the kernels'
modules are imported), which is how the tests hold them to the reference.
"""
