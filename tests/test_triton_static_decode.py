"""Fixed-shape decode steps over the Triton kernels: one shape per batch size, every graph
captured when the runner is built (ENG-228), padded rows that write and read nothing
(ENG-229).

Captures need a GPU; here the steps run eagerly on the CPU under Triton's interpreter (the code
a graph captures), and a stand-in capture records when, how often and into which pool each
size is captured.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest
import torch

from pagedkv.accel.cuda import triton_static_decode
from pagedkv.accel.cuda.triton_static_decode import PADDED_SLOT, TritonStaticDecode
from pagedkv.accel.cuda.triton_store import TritonAttentionMetadata, TritonPagedStore
from pagedkv.accel.static_decode import capture_sizes, resolve_cuda_graphs
from pagedkv.backend import ReferenceBackend
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm import run_to_completion
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.runner_options import RunnerOptions
from pagedkv.interfaces import StoreConfig
from pagedkv.model.loader import load_model
from pagedkv.model.qwen3 import Qwen3ForCausalLM
from pagedkv.model.step_attention import PagedStepAttention
from pagedkv.plan import SeqChunk
from pagedkv.plan_builders import build_paged_plan
from pagedkv.store.paged_store import TorchPagedStore
from pagedkv.testing.tiny_qwen3 import PRESETS, build_tiny_checkpoint, one_torch_thread

PAGE = 5
PAGES = 64
#: Five prompts decoding together: 5 rows padded to 6 with a largest batch of 6; sequences end
#: at different steps (max_tokens below), so a batch of the same padded size shrinks.
PROMPTS = [[3, 1, 4, 1, 5], [7] * 23, [9], list(range(28)), [2, 7] * 6]
MAX_BATCH = 6
TRITON = RunnerOptions(attention="triton")


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(PRESETS["tied-gqa2"], tmp_path_factory.mktemp("tied"))


def _reference_store(model: Qwen3ForCausalLM) -> TorchPagedStore:
    config = model.config
    return TorchPagedStore(
        StoreConfig(
            num_layers=config.num_hidden_layers,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            page_size=PAGE,
            num_pages=PAGES,
        )
    )


def _static_runner(
    checkpoint: Path, *, cuda_graphs: bool, options: RunnerOptions = TRITON
) -> tuple[ModelRunner, TritonPagedStore]:
    """A Triton runner whose decode steps take the fixed-shape path, built over a fresh pool."""
    model = load_model(checkpoint)
    store = TritonPagedStore(_reference_store(model))

    def static(built: Qwen3ForCausalLM) -> TritonStaticDecode:
        return TritonStaticDecode(
            built, store, max_batch=MAX_BATCH, max_width=PAGES * PAGE, cuda_graphs=cuda_graphs
        )

    runner = ModelRunner(
        model, partial(PagedStepAttention.prepare, store), store, options, static_decode=static
    )
    return runner, store


def _generate(runner: ModelRunner) -> list[list[int]]:
    engine = ReferenceBackend().create_engine(runner, EngineConfig(page_size=PAGE, num_pages=PAGES))
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 4, 12, 6, 9)
    ]
    return [list(o.token_ids) for o in run_to_completion(engine, PROMPTS, params)]


def _ordinary(checkpoint: Path, options: RunnerOptions = TRITON) -> ModelRunner:
    model = load_model(checkpoint)
    return ModelRunner.paged(model, _reference_store(model), options)


@pytest.mark.spec("ENG-228", "ENG-229")
def test_every_batch_size_is_captured_when_the_runner_is_built(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in capture (two warm-up runs of the step, as CUDA's, then the step itself)
    records each capture and its pool: every size of 1, 2, 4, 6 is captured once, into one
    pool, before the first step, and no step after captures again, whatever the contexts'
    widths; the warm-ups wrote no K/V; the tokens are the ordinary Triton path's. Kills a
    lazy capture on first use, a capture per width, a pool per graph, and padded rows at
    start whose slot is not -1 (the warm-ups would write slot 0)."""
    captures: list[object] = []
    pools: list[object] = []

    def captured(
        step: Callable[[], None], device: torch.device, pool: object
    ) -> Callable[[], None]:
        step()
        step()
        captures.append(pool)
        return step

    def new_pool() -> object:
        pools.append(object())
        return pools[-1]

    monkeypatch.setattr(triton_static_decode, "captured", captured)
    monkeypatch.setattr(triton_static_decode, "capture_pool", new_pool)
    runner, store = _static_runner(checkpoint, cuda_graphs=True)
    assert len(captures) == len(capture_sizes(MAX_BATCH)) == 4
    assert len(pools) == 1
    assert all(pool is pools[0] for pool in captures)
    for layer in range(store.config.num_layers):
        assert not store.reference.key_pool(layer).any()
        assert not store.reference.value_pool(layer).any()
    assert _generate(runner) == _generate(_ordinary(checkpoint))
    assert len(captures) == 4  # the steps replayed; none captured


@pytest.mark.spec("ENG-229", "ENG-220")
@pytest.mark.parametrize(
    "options",
    [TRITON, RunnerOptions(attention="triton", fused_ops="triton")],
    ids=["attention", "attention-and-fused-ops"],
)
def test_fixed_shape_steps_give_the_ordinary_tokens(
    checkpoint: Path, options: RunnerOptions
) -> None:
    """Run eagerly: five sequences decode padded to 6, then fewer as they end, contexts from 1
    to 40 positions over non-contiguous pages; every token is the ordinary Triton path's, and
    the fixed-shape path ran (its buffers hold the last step's rows); with the fused Triton
    norms, rotations and activations too (what a CUDA graph of that runner captures). Kills
    padded rows that leak into a real row, or a page table copied into the wrong columns."""
    runner, _ = _static_runner(checkpoint, cuda_graphs=False, options=options)
    assert _generate(runner) == _generate(_ordinary(checkpoint, options))
    static = runner._static
    assert isinstance(static, TritonStaticDecode)
    assert static.shapes == list(capture_sizes(MAX_BATCH))
    assert int(static._buffers.context_lens.max()) > 0  # decode steps ran on the buffers


def _decode_plan(pages: list[int], context: int) -> list[SeqChunk]:
    """One decode row per page: a sequence whose ``context``-th position is computed now."""
    return [SeqChunk((1,), context - 1, (page,)) for page in pages]


@pytest.mark.spec("ENG-229")
def test_a_row_left_by_a_larger_batch_writes_nothing(checkpoint: Path) -> None:
    """A batch of 4 then a batch of 3 at the same padded size 4: the fourth row's old slot is
    given to another sequence in between (here: zeroed, as a new owner's write would leave
    it changed); the batch of 3 must not write it. Kills buffers whose rows past the batch
    keep their old slot (they would overwrite another sequence's K/V in every step)."""
    model = load_model(checkpoint)
    store = TritonPagedStore(_reference_store(model))
    static = TritonStaticDecode(
        model, store, max_batch=4, max_width=PAGES * PAGE, cuda_graphs=False
    )
    with torch.inference_mode():
        four = build_paged_plan(_decode_plan([3, 8, 12, 20], context=3), PAGE)
        metadata = store.prepare(four.attention)
        static.run(four, metadata)
        taken = 20 * PAGE + 2  # the fourth row's slot
        keys = store.reference.key_pool(0).flatten(0, 1)
        assert keys[taken].any()
        keys[taken].zero_()
        three = build_paged_plan(_decode_plan([3, 8, 12], context=3), PAGE)
        logits = static.run(three, store.prepare(three.attention))
    assert logits.shape[0] == 3
    assert not keys[taken].any()
    assert int(static._buffers.slots[3]) == PADDED_SLOT


@pytest.mark.spec("ENG-228")
def test_a_table_wider_than_the_fixed_width_takes_the_ordinary_path(checkpoint: Path) -> None:
    """A plan whose page table has more columns than the fixed width (a runner built for
    shorter contexts) does not fit, nor does a step of several rows per sequence or a
    reference store's metadata; the runner then runs the ordinary path. Kills a fit that
    copies a wider table into the fixed buffer (a shape error inside a replay)."""
    model = load_model(checkpoint)
    store = TritonPagedStore(_reference_store(model))
    static = TritonStaticDecode(model, store, max_batch=4, max_width=2 * PAGE, cuda_graphs=False)
    narrow = build_paged_plan(_decode_plan([3, 8], context=3), PAGE)
    wide = build_paged_plan([SeqChunk((1,), 11, (3, 4, 5))], PAGE)
    prefill = build_paged_plan([SeqChunk((1, 2, 3), 0, (3,))], PAGE)
    assert static.fits(narrow, store.prepare(narrow.attention))
    assert not static.fits(wide, store.prepare(wide.attention))
    assert not static.fits(prefill, store.prepare(prefill.attention))
    assert not static.fits(narrow, store.reference.prepare(narrow.attention))
    assert isinstance(store.prepare(narrow.attention), TritonAttentionMetadata)


@pytest.mark.spec("ENG-205", "ENG-228")
def test_unset_cuda_graphs_are_on_for_the_triton_store_on_cuda() -> None:
    """Unset, the graphs are on for a whole model on CUDA with ``attention="triton"`` (its
    store is then the Triton store), off when compiled. Kills a default that leaves the Triton
    path eager on CUDA."""
    from types import SimpleNamespace
    from typing import Any

    weight = SimpleNamespace(device=torch.device("cuda"))
    cuda_model: Any = SimpleNamespace(
        parameters=lambda: iter([weight]), layout=SimpleNamespace(size=1)
    )
    reference = TorchPagedStore(StoreConfig(1, 1, 4, 2, 2))
    triton_store = TritonPagedStore(reference)
    assert resolve_cuda_graphs(TRITON, cuda_model, triton_store).cuda_graphs is True
    compiled = RunnerOptions(attention="triton", compile=True)
    assert resolve_cuda_graphs(compiled, cuda_model, triton_store).cuda_graphs is False


@pytest.mark.spec("ENG-228", "ENG-229")
def test_cuda_triton_graphs_give_the_eager_tokens(checkpoint: Path) -> None:
    """On CUDA: with ``attention="triton"`` and the default options, every batch size is
    captured when the runner is built, and decode steps replayed from those graphs give the
    eager Triton path's tokens."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available on this machine")

    def runner(graphs: bool | None) -> ModelRunner:
        model = load_model(checkpoint, device="cuda")
        options = RunnerOptions(attention="triton", cuda_graphs=graphs)
        return ModelRunner.for_model(model, num_pages=PAGES, page_size=PAGE, options=options)

    captured_runner = runner(None)
    static = captured_runner._static
    assert isinstance(static, TritonStaticDecode)
    assert static.shapes == list(static.batch_sizes)
    assert _generate(captured_runner) == _generate(runner(False))
