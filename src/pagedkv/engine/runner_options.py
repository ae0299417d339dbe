"""How a model runner runs its model: options that change speed, never which tokens come out.

torch-free, so a backend can carry them without importing the model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RunnerOptions:
    """Options of :class:`~pagedkv.engine.runner.ModelRunner`.

    Attributes:
        pack_weights: repack linear weights for oneDNN where it is faster (float32 on a CPU
            with oneDNN, bfloat16 where it has bfloat16 kernels; :mod:`pagedkv.model.packing`);
            elsewhere it changes nothing.
        compile: run decode steps through ``torch.compile`` (inductor), one compiled step per
            fixed shape (:mod:`pagedkv.engine.static_decode`); the first step of each new
            shape pays the compilation. Prefill runs eagerly. v1 runners only.
        cuda_graphs: replay decode steps from CUDA graphs captured per fixed shape
            (:mod:`pagedkv.engine.static_decode`); v1 runners on a CUDA device only.
    """

    pack_weights: bool = True
    compile: bool = False
    cuda_graphs: bool = False
