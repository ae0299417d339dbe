"""Mutants of the fused Triton kernels (ENG-221..ENG-223): a kernel module's source with one
fragment replaced, written to a file of its own and imported under a name of its own, so the
same checks the real kernels pass can be shown to fail on it (Triton reads a kernel's source
from its file, under its interpreter as on a GPU)."""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from pagedkv.accel.cuda import norm_kernel, swiglu_kernel


@dataclass(frozen=True)
class KernelMutant:
    """``original``'s source with ``fragment`` (found exactly once) replaced by
    ``replacement``."""

    name: str
    original: ModuleType
    fragment: str
    replacement: str

    def load(self, folder: Path) -> ModuleType:
        """The mutated module, imported from a file in ``folder``.

        Raises:
            ValueError: the fragment is not in the source exactly once (the kernel moved on and
                the mutant no longer mutates it).
        """
        source = inspect.getsource(self.original)
        if source.count(self.fragment) != 1:
            raise ValueError(f"{self.name}: the fragment is not in the source exactly once")
        path = folder / f"mutant_{self.name}.py"
        path.write_text(source.replace(self.fragment, self.replacement), encoding="utf-8")
        spec = importlib.util.spec_from_file_location(f"mutant_{self.name}", path)
        if spec is None or spec.loader is None:
            raise ValueError(f"{self.name}: cannot import {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


NORM_MUTANTS = (
    KernelMutant(
        "sum_not_written",
        norm_kernel,
        "        tl.store(total_ptr + row * stride_total + cols, x, mask=mask)\n",
        "",
    ),
    KernelMutant(
        "eps_outside_the_root",
        norm_kernel,
        "tl.rsqrt(mean + eps)",
        "(tl.rsqrt(mean) + eps)",
    ),
    KernelMutant(
        "norm_before_the_add",
        norm_kernel,
        "    x32 = x.to(tl.float32)\n    mean",
        "    x32 = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)\n"
        "    mean",
    ),
)

ROPE_MUTANTS = (
    KernelMutant(
        "halves_swapped",
        norm_kernel,
        "tl.where(first, -normed_partner.to(tl.float32), normed_partner.to(tl.float32))",
        "tl.where(first, normed_partner.to(tl.float32), -normed_partner.to(tl.float32))",
    ),
    KernelMutant(
        "partner_scaled_by_its_own_weight",
        norm_kernel,
        "normed_partner = (weight_partner *",
        "normed_partner = (weight *",
    ),
    KernelMutant(
        "rope_eps_outside_the_root",
        norm_kernel,
        "tl.rsqrt(tl.sum(x * x, axis=0) / HEAD_DIM + eps)",
        "(tl.rsqrt(tl.sum(x * x, axis=0) / HEAD_DIM) + eps)",
    ),
)

SWIGLU_MUTANTS = (
    KernelMutant(
        "gate_and_up_swapped",
        swiglu_kernel,
        "    gate = tl.load(at, mask=mask, other=0.0).to(tl.float32)\n"
        "    up = tl.load(at + width, mask=mask, other=0.0).to(tl.float32)\n",
        "    gate = tl.load(at + width, mask=mask, other=0.0).to(tl.float32)\n"
        "    up = tl.load(at, mask=mask, other=0.0).to(tl.float32)\n",
    ),
    KernelMutant(
        "column_block_ignored",
        swiglu_kernel,
        "cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)",
        "cols = tl.program_id(1) * 0 + tl.arange(0, BLOCK)",
    ),
)
