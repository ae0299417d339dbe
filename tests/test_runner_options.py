"""Runner options change speed, never tokens: merged projections, packed weights, the
fixed-shape decode path (CUDA graphs on a GPU, torch.compile on CPU) and their refusals.

The fixed-shape path is exercised on the CPU by running it eagerly (no capture, no compile):
the buffers, the padding by row 0 and the gather are the code a CUDA graph captures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config

from pagedkv.accel import static_decode
from pagedkv.accel.cpu.builder import weight_nbytes
from pagedkv.accel.cpu.onednn import packing_supported
from pagedkv.accel.cpu.packed_linear import PackedProduct, is_packed
from pagedkv.accel.static_decode import MIN_WIDTH, StaticDecode, bucket
from pagedkv.backend import ReferenceBackend
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm import run_to_completion
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.runner_options import RunnerOptions
from pagedkv.errors import InvalidRequest
from pagedkv.model.layers import Linear
from pagedkv.model.loader import load_model
from pagedkv.model.qwen3 import Qwen3ForCausalLM
from pagedkv.model.step_attention import PagedStepAttention
from pagedkv.store.paged_store import TorchPagedStore
from pagedkv.testing.tiny_qwen3 import PRESETS, build_tiny_checkpoint, one_torch_thread

PAGE = 5
PAGES = 96
#: Prompts whose decode batches are 4, then 3 (padded to 4) and 1, crossing gather widths 64
#: and 128, with a 1-token prompt and one on a page boundary.
PROMPTS = [[3, 1, 4, 1, 5], [7] * 23, [9], list(range(60))]
PARAMS = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(PRESETS["tied-gqa2"], tmp_path_factory.mktemp("tied"))


def paged_runner(
    path: Path, options: RunnerOptions | None = None, dtype: str = "float32", device: str = "cpu"
) -> ModelRunner:
    return ModelRunner.from_model_dir(
        path, num_pages=PAGES, page_size=PAGE, dtype=dtype, device=device, options=options
    )


def static_runner(path: Path) -> tuple[ModelRunner, StaticDecode]:
    """A runner whose decode steps take the fixed-shape path, run eagerly."""
    model = load_model(path)
    runner = paged_runner(path)
    store = runner_store(runner)

    def static(built: Qwen3ForCausalLM) -> StaticDecode:
        return StaticDecode(
            built, store, max_batch=8, max_width=512, cuda_graphs=False, compile=False
        )

    runner = ModelRunner(model, runner._prepare, store, static_decode=static)
    assert runner._static is not None
    return runner, runner._static


def runner_store(runner: ModelRunner) -> TorchPagedStore:
    store = runner._prepare.args[0]  # type: ignore[attr-defined]
    assert isinstance(store, TorchPagedStore)
    return store


def generate(runner: ModelRunner) -> list[list[int]]:
    engine = ReferenceBackend().create_engine(runner, EngineConfig(page_size=PAGE, num_pages=PAGES))
    return [list(o.token_ids) for o in run_to_completion(engine, PROMPTS, PARAMS)]


@pytest.mark.spec("ENG-110", "ENG-112")
def test_fixed_shape_decode_gives_the_ordinary_tokens_and_cache(checkpoint: Path) -> None:
    """Padded batches and gathers change nothing: same tokens, and the K/V of every slot as
    the ordinary path writes it (to rounding: a batch of 4 rows rounds unlike one of 3)."""
    ordinary = paged_runner(checkpoint)
    runner, static = static_runner(checkpoint)
    assert generate(runner) == generate(ordinary)
    assert static.shapes == [(4, MIN_WIDTH), (4, 2 * MIN_WIDTH)]
    # The pools of both runners hold the same K/V at every slot the requests wrote.
    ours, theirs = runner_store(runner), runner_store(ordinary)
    for layer in range(ours.config.num_layers):
        torch.testing.assert_close(ours.key_pool(layer), theirs.key_pool(layer))
        torch.testing.assert_close(ours.value_pool(layer), theirs.value_pool(layer))


@pytest.mark.spec("ENG-112", "ENG-113")
def test_a_capture_warm_up_writes_only_the_plans_own_slots(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CUDA graph is captured after warm-up runs of the step, for real, on its buffers. Run
    here by a stand-in capture that does the same on the CPU: the warm-ups of each new shape
    must write no slot but the plan's, so the tokens stay the ordinary path's."""
    warm_ups: list[int] = []

    def captured(
        step: Callable[[], None], device: torch.device, pool: object
    ) -> Callable[[], None]:
        for _ in range(2):
            step()
            warm_ups.append(1)
        return step

    monkeypatch.setattr(static_decode, "captured", captured)
    monkeypatch.setattr(static_decode, "capture_pool", object)
    model = load_model(checkpoint)
    store = runner_store(paged_runner(checkpoint))

    def static(built: Qwen3ForCausalLM) -> StaticDecode:
        return StaticDecode(
            built, store, max_batch=8, max_width=512, cuda_graphs=True, compile=False
        )

    runner = ModelRunner(
        model, partial(PagedStepAttention.prepare, store), store, static_decode=static
    )
    assert generate(runner) == generate(paged_runner(checkpoint))
    assert runner._static is not None
    assert len(warm_ups) == 2 * len(runner._static.shapes) > 0


def test_bucket_rounds_up_to_powers_of_two() -> None:
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert bucket(3, MIN_WIDTH) == MIN_WIDTH
    assert bucket(65, MIN_WIDTH) == 128


@pytest.mark.spec("ENG-110", "ENG-115")
@pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="inductor packs linear weights with oneDNN"
)
def test_compiled_decode_freezes_and_packs_the_weights(checkpoint: Path) -> None:
    """Each compiled shape packs every linear of the model (4 a layer, and the LM head), and
    the tokens are the eager path's."""
    counters.clear()
    runner = paged_runner(checkpoint, RunnerOptions(compile=True))
    with inductor_config.patch(force_disable_caches=True):  # a cached step runs no pass
        assert generate(runner) == generate(paged_runner(checkpoint))
    static = runner._static
    assert static is not None
    assert static.shapes == [(4, MIN_WIDTH), (4, 2 * MIN_WIDTH)]
    linears = 4 * runner.model.config.num_hidden_layers + 1
    packed = counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"]
    assert packed == linears * len(static.shapes)
    assert not is_packed(runner.model)


@pytest.mark.spec("ENG-111")
def test_options_a_runner_cannot_honour_are_refused(checkpoint: Path) -> None:
    with pytest.raises(InvalidRequest, match="compile and cuda_graphs exclude each other"):
        paged_runner(checkpoint, RunnerOptions(compile=True, cuda_graphs=True))
    with pytest.raises(InvalidRequest, match="cuda_graphs needs a model on a CUDA device"):
        paged_runner(checkpoint, RunnerOptions(cuda_graphs=True))
    with pytest.raises(InvalidRequest, match="v1"):
        ModelRunner.from_model_dir(
            checkpoint, num_pages=None, page_size=PAGE, options=RunnerOptions(compile=True)
        )
    with pytest.raises(InvalidRequest, match="compile needs plain weights"):
        paged_runner(checkpoint, RunnerOptions(compile=True, pack_weights=True))
    packed = paged_runner(checkpoint)  # packs where oneDNN is faster: float32 wherever it runs
    assert is_packed(packed.model) == packing_supported(torch.float32, torch.device("cpu"))
    if is_packed(packed.model):
        with pytest.raises(InvalidRequest, match="packed by another runner"):
            ModelRunner.paged(packed.model, runner_store(packed), RunnerOptions(compile=True))


@pytest.mark.spec("ENG-111")
def test_compiling_runners_leave_the_weights_plain(checkpoint: Path) -> None:
    """Unset, pack_weights packs unless compile is on; a compiling runner's model stays plain."""
    assert RunnerOptions().packs
    assert RunnerOptions(pack_weights=True).packs
    assert not RunnerOptions(compile=True).packs
    assert not RunnerOptions(pack_weights=False).packs
    assert not is_packed(paged_runner(checkpoint, RunnerOptions(compile=True)).model)


@pytest.mark.spec("ENG-114", "ENG-111")
@pytest.mark.parametrize(
    ("wanted", "device_type", "applies"),
    [(None, "cpu", True), (None, "cuda", False), (False, "cpu", False), (True, "cuda", True)],
)
def test_retain_freed_memory_applies_as_asked(
    checkpoint: Path,
    monkeypatch: pytest.MonkeyPatch,
    wanted: bool | None,
    device_type: str,
    applies: bool,
) -> None:
    """Unset, a runner keeps freed memory for a model on the CPU only; ``False`` never,
    ``True`` wherever the model is (the setting is the host process's)."""
    calls: list[bool] = []

    def retain() -> int:
        calls.append(True)
        return 1 << 30

    monkeypatch.setattr("pagedkv.engine.runner.retain_freed_memory", retain)
    runner = paged_runner(checkpoint, RunnerOptions(retain_freed_memory=wanted))
    if device_type != "cpu":  # no model can be put there: the runner's own check, on it
        calls.clear()
        runner._retain_freed_memory(torch.device(device_type))
    assert calls == ([True] if applies else [])


@pytest.mark.spec("ENG-114", "ENG-111")
def test_retain_freed_memory_without_mallopt(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asked for where the C library cannot, it is refused naming it; unset, nothing happens."""
    monkeypatch.setattr("pagedkv.engine.runner.retain_freed_memory", lambda: 0)
    with pytest.raises(InvalidRequest, match="retain_freed_memory"):
        paged_runner(checkpoint, RunnerOptions(retain_freed_memory=True))
    assert paged_runner(checkpoint).options.retain_freed_memory is None


#: How far a packed layer's output may be from the plain one's, by dtype: float32 differs only
#: by the order of its sums (measured 2.4e-7 on these inputs), bfloat16 by its rounding.
PACKED_TOLERANCE = {"float32": (1e-5, 1e-5), "bfloat16": (0.05, 0.02)}


@pytest.mark.spec("ENG-110")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_packing_touches_only_what_it_speeds_up(checkpoint: Path, dtype: str) -> None:
    """float32 and (where oneDNN has bfloat16 kernels) bfloat16 are repacked, keeping one copy
    of each weight, the byte count unchanged and the outputs those of the plain model; float16
    never is."""
    model = load_model(checkpoint, dtype=dtype)
    before = weight_nbytes(model)
    only_packing = RunnerOptions(fused_norms=False, fused_swiglu=False, packed_gemv=False)
    built = ModelRunner.recompute(model, only_packing).model
    assert weight_nbytes(built) == before
    supported = packing_supported(getattr(torch, dtype), torch.device("cpu"))
    if dtype == "float16" or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        assert not supported
    if dtype == "float32" and torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        assert supported
    if not supported:
        assert not is_packed(built)
        assert built.lm_head is None
        return
    assert isinstance(built.lm_head, PackedProduct)  # the tied head's own packed copy
    linears = [m for m in built.modules() if isinstance(m, Linear) and m is not built.lm_head]
    plain = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(isinstance(m, PackedProduct) and m.weight is None for m in linears)
    assert all(m.weight is not None for m in plain)  # the model given keeps its own
    atol, rtol = PACKED_TOLERANCE[dtype]
    for ours, theirs in zip(linears, plain, strict=True):
        x = torch.randn(3, ours.in_features).to(getattr(torch, dtype))
        torch.testing.assert_close(ours(x), theirs(x), atol=atol, rtol=rtol)


@pytest.mark.spec("ENG-110")
def test_packed_float32_generates_the_plain_tokens(checkpoint: Path) -> None:
    """Greedy float32 tokens with and without packing are the same, token for token."""

    def run(pack: bool) -> list[list[int]]:
        return generate(paged_runner(checkpoint, RunnerOptions(pack_weights=pack)))

    assert run(True) == run(False)


@pytest.mark.spec("ENG-110")
def test_packed_bfloat16_generates_the_plain_tokens(tmp_path: Path) -> None:
    """Greedy bfloat16 tokens with and without packing (tolerance of GLD-016: the margins of
    these prompts are far above one bfloat16 step, so the tokens are equal)."""
    path = build_tiny_checkpoint(PRESETS["untied-gqa4-wide"], tmp_path / "bf16", dtype="bfloat16")

    def run(pack: bool) -> list[list[int]]:
        return generate(paged_runner(path, RunnerOptions(pack_weights=pack), dtype="bfloat16"))

    assert run(True) == run(False)


@pytest.mark.spec("ENG-113")
def test_cuda_graph_decode_gives_the_eager_tokens(checkpoint: Path) -> None:
    """On CUDA: decode steps replayed from captured graphs give the eager path's tokens."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available on this machine")

    def run(graphs: bool) -> list[list[int]]:
        return generate(paged_runner(checkpoint, RunnerOptions(cuda_graphs=graphs), device="cuda"))

    assert run(True) == run(False)
