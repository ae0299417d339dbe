"""Each row of a batch's logits summarised in one C call (``native/logit_summary.c``, built on
first use by :mod:`pagedkv.native.build`): its largest value, the first index holding it, and
``log(sum(exp(x - largest)))``, so that greedy tokens and the chosen tokens' log-probabilities
need no float32 copy of the logits and no ``[R, vocab]`` log-softmax (ENG-158). A row holding a
NaN is marked by a NaN largest value, so the engine finds the rows it must fail (ENG-070) in the
summary rather than in a pass of its own over the logits.

Why: a decode step of 32 rows of Qwen3's 151936-token vocabulary converted them to float32,
took their log-softmax and their maximum, each a pass writing or reading 19 MB: 28 ms of an
engine step of the 0.6B shape under the profiler (bfloat16, two cores). The summary takes 2-3
ms, and the step's sampling went from 14-15 to 6 ms.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedkv.native.build import BuildFailure, load_library

#: The kernel's C source, shipped with the package.
SOURCE = Path(__file__).with_name("native") / "logit_summary.c"

#: Logit dtypes the kernel reads: the entry point's first argument for each.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

#: dtype code, portable flag, logits, rows, vocab, row stride, three outputs, threads.
_ARGTYPES: list[Any] = [
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_void_p,
    *[ctypes.c_int64] * 3,
    *[ctypes.c_void_p] * 3,
    ctypes.c_int,
]


@dataclass(frozen=True, slots=True)
class RowSummary:
    """One batch's rows, each tensor ``[R]`` on the CPU.

    Attributes:
        largest: each row's largest logit, float32; NaN for a row holding a NaN (whose other
            two values then mean nothing).
        index: the first index holding it (torch's argmax), int64.
        log_sum: ``log(sum(exp(x - largest)))`` over the row, float32.
    """

    largest: torch.Tensor
    index: torch.Tensor
    log_sum: torch.Tensor

    def logprobs(self, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """``log_softmax(logits)[r, tokens[r]]`` for every row, float32 ``[R]``, summed in
        the same order as the summary."""
        chosen = logits.gather(1, tokens.unsqueeze(1)).squeeze(1).float()
        return (chosen - self.largest) - self.log_sum


class LogitSummary:
    """The kernel. Build it with :meth:`build`; call it on logits :meth:`takes` accepts."""

    def __init__(self, library: ctypes.CDLL, *, portable: bool = False) -> None:
        self._entry = library.logit_summary
        self._entry.argtypes = _ARGTYPES
        self._entry.restype = ctypes.c_int
        self._portable = portable

    @classmethod
    def build(
        cls, folder: Path | None = None, *, portable: bool = False
    ) -> LogitSummary | BuildFailure:
        """The kernel, built if needed (``portable``: its loops for any CPU, even where its
        16-lane ones are built); the reason it cannot be."""
        library = load_library(SOURCE, folder)
        return library if isinstance(library, BuildFailure) else cls(library, portable=portable)

    def takes(self, logits: torch.Tensor) -> bool:
        """Whether ``logits`` can be summarised here: ``[R, vocab]`` float32 or bfloat16 on
        the CPU, rows contiguous, ``1 <= vocab < 2**31``, not inside ``torch.compile``."""
        return (
            logits.dim() == 2
            and logits.dtype in DTYPE_CODES
            and logits.device.type == "cpu"
            and logits.stride(1) == 1
            and 1 <= logits.shape[1] < 2**31
            and not torch.compiler.is_compiling()
        )

    def __call__(self, logits: torch.Tensor) -> RowSummary:
        """The summary of every row of ``logits``, which :meth:`takes` accepts; a row holding
        a NaN is summarised with a NaN largest value."""
        rows, vocab = logits.shape
        largest = torch.empty(rows, dtype=torch.float32)
        index = torch.empty(rows, dtype=torch.int64)
        log_sum = torch.empty(rows, dtype=torch.float32)
        if rows > 0:
            self._entry(
                DTYPE_CODES[logits.dtype],
                int(self._portable),
                logits.data_ptr(),
                rows,
                vocab,
                logits.stride(0),
                largest.data_ptr(),
                index.data_ptr(),
                log_sum.data_ptr(),
                torch.get_num_threads(),
            )
        return RowSummary(largest, index, log_sum)
