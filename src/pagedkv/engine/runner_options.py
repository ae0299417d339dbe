"""How a model runner runs its model: options that change speed, never which tokens come out.

torch-free, so a backend can carry them without importing the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.errors import InvalidRequest

#: The values of :attr:`RunnerOptions.attention`.
ATTENTION_KERNELS = ("reference", "triton")

#: The values of :attr:`RunnerOptions.fused_ops`.
FUSED_OPS_KERNELS = ("reference", "triton")


@dataclass(frozen=True, slots=True)
class RunnerOptions:
    """Options of :class:`~pagedkv.engine.runner.ModelRunner`.

    Attributes:
        pack_weights: repack linear weights for oneDNN where it is faster (float32 on a CPU
            with oneDNN, bfloat16 where it has bfloat16 kernels; :mod:`pagedkv.accel.cpu.onednn`);
            elsewhere it changes nothing. ``None`` (the default): pack unless ``compile`` is on,
            since inductor cannot lower oneDNN's packed weights (and packs its own); ``True``
            with ``compile`` is refused.
        compile: run decode steps through ``torch.compile`` (inductor), one compiled step per
            fixed shape (:mod:`pagedkv.accel.static_decode`), the weights frozen into it and
            packed by inductor (ENG-115); the first step of each new shape pays the
            compilation (tens of seconds for the 0.6B shape on two cores) and each shape
            holds its own packed copy of the weights. Faster than eager in bfloat16, slower
            in float32. Prefill runs eagerly. v1 runners only.
        cuda_graphs: replay decode steps from CUDA graphs captured per fixed shape
            (:mod:`pagedkv.accel.static_decode`); v1 runners on a CUDA device only. ``None``
            (the default): on for a v1 runner over the reference store, or with
            ``attention="triton"`` (every batch size captured at start, ENG-228), whose model
            is on a CUDA device, unsharded and not compiled, off elsewhere (ENG-205); vLLM's
            ``enforce_eager=True`` sets it ``False``.
        retain_freed_memory: keep the memory steps free inside the process, so that their
            large temporaries are not faulted in again layer after layer
            (:mod:`pagedkv.accel.cpu.host_memory`; a setting of the whole process). ``None``
            (the default): on for a model on the CPU where the C library is glibc; ``True``
            where it is not is refused.
        fused_norms: run every RMSNorm in one call of a small C kernel, fused with the
            residual add before it or the RoPE rotation after it
            (:mod:`pagedkv.accel.cpu.fused_norms`). ``None`` (the default): on for a float32 or
            bfloat16 model on the CPU where the kernel builds; ``True`` where it cannot be
            built or the model is of another dtype or device is refused, and so is ``False``
            on a model another runner fused.
        fused_swiglu: run every dense MLP's activation ``silu(gate) * up`` in one call of a
            small C kernel reading the merged gate/up product in place
            (:mod:`pagedkv.accel.cpu.fused_swiglu`). ``None`` (the default): on for a float32 or
            bfloat16 model on the CPU where the kernel builds; ``True`` where it cannot be
            built or the model is of another dtype or device is refused, and so is ``False``
            on a model another runner fused.
        packed_gemv: run the products of one to four rows with a packed weight through a
            small C kernel that reads oneDNN's packed layout itself
            (:mod:`pagedkv.accel.cpu.packed_gemv`; decode steps of few sequences, the LM head of
            a prefill), each layer only once its layout was checked byte for byte. ``None``
            (the default): on for every packed layer where the kernel builds; ``True`` where
            it cannot be built or no layer holds a weight it reads (``pack_weights`` off,
            ``compile`` on, another dtype or device) is refused, and so is ``False`` on a
            model whose layers another runner gave the kernel.
        decode_layers: run every decoder layer of a decode step (one row per sequence, no
            more rows than the packed products take) in one C call
            (:mod:`pagedkv.accel.cpu.decode_layers`, ENG-160): the kernels the modules call, in
            their order, so the same tokens to the bit, without the Python between them. It
            needs what it calls: fused norms and SwiGLU, every layer product read by the
            packed GEMV, a dense model of one rank without attention bias, and a v1 runner
            over the reference store whose decode attention is its C kernel, in the model's
            dtype. ``None`` (the default): on where all of that holds; ``True`` where it does
            not is refused.
        attention: the kernels a v1 runner writes and attends the paged K/V with (ENG-199):
            ``"reference"`` (the default), the store's own (:mod:`pagedkv.store`);
            ``"triton"``, the Triton kernels of :mod:`pagedkv.accel.cuda` reading the pages in
            place (a store kernel, a split-K decode and a varlen prefill), over the same
            pools. ``"triton"`` needs triton installed and a pool on a CUDA device (or, on
            the CPU, Triton's interpreter, ``TRITON_INTERPRET=1``, which the tests use), steps
            that are not compiled (``compile`` off) and no ``decode_layers``; where
            it cannot run it is refused, naming the reason. Any other value is refused.
        fused_ops: the kernels of the position-wise modules of the layers (ENG-220):
            ``"reference"`` (the default), the reference modules (or the CPU's C kernels of
            ``fused_norms`` and ``fused_swiglu``); ``"triton"``, the Triton kernels of
            :mod:`pagedkv.accel.cuda` for every RMSNorm (fused with the residual add before it),
            every query/key norm with the rotation after it, and every dense MLP's SwiGLU
            activation: a few launches a layer where the modules make dozens. An option of its
            own rather than part of ``attention``: these kernels read no pool, so v0 runners
            and the reference store run them too, and each choice can be timed alone.
            ``"triton"`` needs triton installed and a model on a CUDA device (or, on the CPU,
            Triton's interpreter, ``TRITON_INTERPRET=1``), steps that are not compiled
            (``compile`` off; CUDA graphs capture them, ENG-228), and neither
            ``fused_norms=True`` nor ``fused_swiglu=True`` (the C kernels of the same
            modules, off with it when unset); where it cannot run it is refused, naming the
            reason. Any other value is refused.

        max_decode_batch: the largest decode batch run on fixed shapes (``cuda_graphs`` or
            ``compile``): their batch sizes are 1, 2, 4, ... below it and it itself (ENG-206,
            ENG-226). ``None`` (the default): the engine's ``max_num_seqs`` where an engine
            builds the runner (:meth:`~pagedkv.backend.ReferenceBackend.load_engine`), as vLLM
            captures up to its ``max_num_seqs``; 256 for a runner built alone.

    Raises:
        InvalidRequest: an ``attention`` other than those of :data:`ATTENTION_KERNELS`, or a
            ``fused_ops`` other than those of :data:`FUSED_OPS_KERNELS`, or a
            ``max_decode_batch`` below 1.
    """

    pack_weights: bool | None = None
    compile: bool = False
    cuda_graphs: bool | None = None
    retain_freed_memory: bool | None = None
    fused_norms: bool | None = None
    fused_swiglu: bool | None = None
    packed_gemv: bool | None = None
    decode_layers: bool | None = None
    attention: str = "reference"
    fused_ops: str = "reference"
    max_decode_batch: int | None = None

    def __post_init__(self) -> None:
        if self.max_decode_batch is not None and self.max_decode_batch < 1:
            raise InvalidRequest(f"max_decode_batch must be >= 1, got {self.max_decode_batch}")
        if self.attention not in ATTENTION_KERNELS:
            raise InvalidRequest(
                f"attention={self.attention!r}: one of {', '.join(ATTENTION_KERNELS)}"
            )
        if self.fused_ops not in FUSED_OPS_KERNELS:
            raise InvalidRequest(
                f"fused_ops={self.fused_ops!r}: one of {', '.join(FUSED_OPS_KERNELS)}"
            )

    @property
    def packs(self) -> bool:
        """Whether the runner packs its model's weights (``pack_weights`` resolved)."""
        return self.pack_weights if self.pack_weights is not None else not self.compile
