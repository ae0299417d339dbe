"""Resolves the runner's ``fused_ops`` option (ENG-220): the model whose norms, rotations and
SwiGLU activations a runner launches as this room's Triton kernels.

``"reference"`` keeps the model given. ``"triton"`` gives a copy of its module tree (sharing
its tensors) in which every RMSNorm, dense MLP and MoE expert block is its Triton substitute
and the rotary embedding reads a table of the served context's positions
(:mod:`pagedkv.accel.cuda.fused_modules`), the model given left as it is (another runner may
hold it). Triton is imported here, and only here, when it is asked for: a process that never
asks needs no triton.
"""

from __future__ import annotations

import importlib.util
from functools import partial

from pagedkv.accel.cpu.fused_norms import has_fused_norms
from pagedkv.accel.cpu.fused_swiglu import has_fused_swiglu
from pagedkv.accel.cuda.triton_substitute import has_triton_substitutes
from pagedkv.accel.substitution import substituted_copy
from pagedkv.engine.runner_options import RunnerOptions
from pagedkv.errors import InvalidRequest
from pagedkv.model.qwen3 import Qwen3ForCausalLM


def fused_ops_model(model: Qwen3ForCausalLM, options: RunnerOptions) -> Qwen3ForCausalLM:
    """The model a runner with ``options`` (``cuda_graphs`` resolved) builds on in place of
    ``model``.

    Raises:
        InvalidRequest: ``fused_ops="triton"`` where it cannot run: with ``compile``, with
            ``fused_norms=True`` or ``fused_swiglu=True``, on a model whose norms or MLPs
            another runner fused in C, without triton installed, or on a
            model neither on a CUDA device nor on the CPU under Triton's interpreter;
            ``"reference"`` on a model another runner gave the Triton modules.
    """
    if options.fused_ops == "reference":
        if has_triton_substitutes(model):
            raise InvalidRequest(
                "fused_ops='reference' on a model whose modules another runner fused with "
                "Triton (their reference forms are not in it)"
            )
        return model
    prefix = f"fused_ops={options.fused_ops!r}"
    if options.compile:
        raise InvalidRequest(
            f"{prefix} runs eager or captured steps; compile compiles the reference modules"
        )
    if options.fused_norms or options.fused_swiglu:
        raise InvalidRequest(
            f"{prefix} replaces the modules that fused_norms and fused_swiglu run in C"
        )
    if has_fused_norms(model) or has_fused_swiglu(model):
        raise InvalidRequest(f"{prefix} on a model whose modules another runner fused in C")
    if importlib.util.find_spec("triton") is None:
        raise InvalidRequest(f"{prefix}: triton is not installed (pip install triton)")
    # Imported only now: importing the kernels imports triton, and defines them for its
    # interpreter or for a GPU once and for all.
    from pagedkv.accel.cuda.fused_modules import kernel_device, substitute

    device = next(model.parameters()).device.type
    if device not in ("cpu", "cuda"):
        raise InvalidRequest(f"{prefix} runs on a CUDA device, not on {device}")
    if device == "cpu" and kernel_device() != "cpu":
        raise InvalidRequest(
            f"{prefix} on a model on the CPU runs only under Triton's interpreter "
            "(TRITON_INTERPRET=1 set before the kernels are first imported)"
        )
    if device != kernel_device():
        raise InvalidRequest(
            f"{prefix} on a model on {device}: the kernels were defined for Triton's "
            "interpreter (TRITON_INTERPRET set), which runs them on the CPU only"
        )
    embeddings = model.model.embed_tokens.weight
    return substituted_copy(
        model,
        partial(
            substitute,
            positions=model.config.max_positions,
            dtype=embeddings.dtype,
            device=embeddings.device,
        ),
    )
