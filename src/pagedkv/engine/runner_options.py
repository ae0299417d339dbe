"""How a model runner runs its model: options that change speed, never which tokens come out.

torch-free, so a backend can carry them without importing the model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RunnerOptions:
    """Options of :class:`~pagedkv.engine.runner.ModelRunner`.

    Attributes:
        pack_weights: repack linear weights for oneDNN where it is faster (bfloat16 on a CPU
            with bfloat16 kernels; :mod:`pagedkv.model.packing`); elsewhere it changes nothing.
        compile: compile each decoder layer's position-wise work (norms, projections, RoPE,
            MLP) with ``torch.compile`` (inductor), attention left eager; the first steps of
            each new shape pay the compilation.
        cuda_graphs: replay decode steps from CUDA graphs captured per batch size
            (:mod:`pagedkv.engine.cuda_graphs`); CUDA only.
    """

    pack_weights: bool = True
    compile: bool = False
    cuda_graphs: bool = False
