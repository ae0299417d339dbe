"""The table of workloads: their names in the order a run measures them, which of them the
quick mode and a CUDA run take, and how to load each one's runner.

The command line reads the names (its ``--only`` choices), the suite and the one-workload
child process read the runners; both import this module and neither imports the other. It
imports no workload module (nor torch) itself: each row's ``load`` does when it is called, so
that building the command line stays cheap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pagedkv.bench.checkpoints import Checkpoint
    from pagedkv.bench.context import BenchContext
    from pagedkv.bench.results import WorkloadResult


class Runner(Protocol):
    """Runs one workload: the run's settings, the small checkpoint and its vocabulary size."""

    def __call__(self, ctx: BenchContext, checkpoint: Checkpoint, vocab: int) -> WorkloadResult:
        """The workload's result."""
        ...


@dataclass(frozen=True, slots=True)
class Workload:
    """One row of the table.

    Attributes:
        name: the workload's name, e.g. ``mixed`` (its ratios are ``<name>.<ratio>``).
        load: imports the workload's module and returns its runner; called only to run it.
        quick: part of ``--quick`` (the CI gate's run): no 0.6B-shaped checkpoint.
        cuda: run by ``--device cuda``: a workload of the 0.6B-shaped checkpoint.
        cpu: run by a full CPU run without ``--only`` (ENG-231); off for a workload sized for
            a GPU, which a CPU run measures only when it is named.
    """

    name: str
    load: Callable[[], Runner]
    quick: bool = False
    cuda: bool = False
    cpu: bool = True


@dataclass(frozen=True, slots=True)
class WorkloadTable:
    """The workloads a command line offers, and how a full run isolates each of them.

    Attributes:
        workloads: every workload, in the order a run measures them.
        child_module: the module ``python -m`` runs to measure one of them in a fresh
            interpreter (SRV-049); it must run the workloads of this same table.
    """

    workloads: tuple[Workload, ...]
    child_module: str

    @property
    def names(self) -> tuple[str, ...]:
        """Every workload's name, in run order."""
        return tuple(w.name for w in self.workloads)

    @property
    def quick_names(self) -> tuple[str, ...]:
        """The workloads of ``--quick``, in run order."""
        return tuple(w.name for w in self.workloads if w.quick)

    @property
    def cpu_names(self) -> tuple[str, ...]:
        """The workloads of a full run on the CPU, in run order (ENG-231)."""
        return tuple(w.name for w in self.workloads if w.cpu)

    @property
    def cuda_names(self) -> tuple[str, ...]:
        """The workloads of ``--device cuda``, in run order."""
        return tuple(w.name for w in self.workloads if w.cuda)

    def runner(self, name: str) -> Runner:
        """The runner of workload ``name``, its module imported.

        Raises:
            KeyError: no workload of that name in this table.
        """
        for workload in self.workloads:
            if workload.name == name:
                return workload.load()
        raise KeyError(f"no workload named {name!r}; the workloads: {', '.join(self.names)}")

    def with_workload(self, workload: Workload, *, after: str, child_module: str) -> WorkloadTable:
        """This table with ``workload`` run right after workload ``after``, each workload of a
        full run isolated by ``child_module`` (which must run the new table).

        Raises:
            KeyError: no workload named ``after``.
        """
        if after not in self.names:
            raise KeyError(f"no workload named {after!r}; the workloads: {', '.join(self.names)}")
        position = self.names.index(after) + 1
        rows = (*self.workloads[:position], workload, *self.workloads[position:])
        return replace(self, workloads=rows, child_module=child_module)


def _micro() -> Runner:
    from pagedkv.bench import micro

    return lambda ctx, checkpoint, vocab: micro.run(ctx)


def _scheduling() -> Runner:
    from pagedkv.bench import scheduling

    return lambda ctx, checkpoint, vocab: scheduling.run(ctx)


def _attention() -> Runner:
    from pagedkv.bench import attention

    return lambda ctx, checkpoint, vocab: attention.run(ctx)


def _memory() -> Runner:
    from pagedkv.bench import memory

    return memory.run


def _shared_prefix() -> Runner:
    from pagedkv.bench import shared_prefix

    return shared_prefix.run


def _mixed() -> Runner:
    from pagedkv.bench import mixed

    return mixed.run


def _scaling() -> Runner:
    from pagedkv.bench import scaling

    return scaling.run


def _decode() -> Runner:
    from pagedkv.bench import decode

    return lambda ctx, checkpoint, vocab: decode.run(ctx)


def _device() -> Runner:
    from pagedkv.bench import device

    return lambda ctx, checkpoint, vocab: device.run(ctx)


def _detokenize() -> Runner:
    from pagedkv.bench import detokenize

    return lambda ctx, checkpoint, vocab: detokenize.run(ctx, checkpoint)


def _structured() -> Runner:
    from pagedkv.bench import structured

    return structured.run


def _parallel() -> Runner:
    from pagedkv.bench import parallel

    return lambda ctx, checkpoint, vocab: parallel.run(ctx, checkpoint)


def _tensor_parallel() -> Runner:
    from pagedkv.bench import tensor_parallel

    return lambda ctx, checkpoint, vocab: tensor_parallel.run(ctx)


#: The workloads of ``pagedkv bench`` (``python -m pagedkv.bench``): pagedkv's own, beside
#: transformers where a workload compares. The project's own measurements add the peers
#: workload (vLLM) to this table (``bench/pagedkv_bench``).
PAGEDKV_WORKLOADS = WorkloadTable(
    workloads=(
        Workload("micro", _micro, quick=True),
        Workload("scheduling", _scheduling, quick=True),
        Workload("attention", _attention, quick=True),
        Workload("memory", _memory, quick=True),
        Workload("shared_prefix", _shared_prefix, quick=True),
        Workload("mixed", _mixed, quick=True),
        Workload("scaling", _scaling),
        Workload("decode", _decode, cuda=True),
        # Sized for a GPU (nano-vllm's 256 sequences of up to 1,024 tokens each): on the CPU,
        # only when named (ENG-231).
        Workload("device", _device, cuda=True, cpu=False),
        Workload("detokenize", _detokenize),
        Workload("structured", _structured),
        Workload("parallel", _parallel),
        Workload("tp", _tensor_parallel),
    ),
    child_module="pagedkv.bench.isolated",
)
