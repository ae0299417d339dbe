"""Tensor parallelism on torch.distributed: the process groups, the worker loop, and the
rank-0 step runner (specs/tensor-parallel.md). The model's side of the split is in
:mod:`pagedkv.model.tensor_parallel`."""
