"""CUDA graphs by vLLM's names: on by default where a runner can capture, off with
``enforce_eager``; the batch sizes decode steps are padded to; one memory pool per runner.

Captures need a GPU; here the decisions are checked on their own, the padding is run eagerly
on the CPU (the code a graph captures), and a stand-in capture records its pool.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pagedkv.accel import static_decode
from pagedkv.accel.static_decode import (
    StaticDecode,
    capture_sizes,
    padded_size,
    resolve_cuda_graphs,
)
from pagedkv.backend import ReferenceBackend
from pagedkv.engine import engine_args
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.engine_args import EngineArgs, engine_args_from_kwargs
from pagedkv.engine.llm import run_to_completion
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.runner_options import RunnerOptions
from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import StoreConfig
from pagedkv.model.loader import load_model
from pagedkv.model.qwen3 import Qwen3ForCausalLM
from pagedkv.model.step_attention import PagedStepAttention
from pagedkv.store.paged_store import TorchPagedStore
from pagedkv.testing.tiny_qwen3 import PRESETS, build_tiny_checkpoint, one_torch_thread

PAGE = 5
PAGES = 160
#: Five prompts decoding together (5 rows, padded to 6 with a largest batch of 6), one of them
#: crossing a gather width of 64 positions, so two shapes are captured.
PROMPTS = [[3, 1, 4, 1, 5], [7] * 23, [9], list(range(58)), [2, 7] * 6]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(PRESETS["tied-gqa2"], tmp_path_factory.mktemp("tied"))


def _cuda_model(shards: int = 1) -> Any:
    """A stand-in model whose weights say they are on a CUDA device (no GPU needed: only the
    device and the shard count are read)."""
    weight = SimpleNamespace(device=torch.device("cuda"))
    return SimpleNamespace(parameters=lambda: iter([weight]), layout=SimpleNamespace(size=shards))


def _store() -> TorchPagedStore:
    return TorchPagedStore(StoreConfig(1, 1, 4, 2, 2))


@pytest.mark.spec("ENG-205")
def test_unset_cuda_graphs_are_on_only_where_a_runner_can_capture() -> None:
    """Unset: on for a whole, uncompiled model on CUDA over the reference store; off on the
    CPU, without a store (v0), compiled, or split over ranks; a set value is kept. Kills a
    default that stays off on CUDA (LLM and serve would run eagerly) or that turns graphs on
    where the capture is refused or impossible."""
    unset = RunnerOptions()
    assert unset.cuda_graphs is None
    assert resolve_cuda_graphs(unset, _cuda_model(), _store()).cuda_graphs is True
    assert resolve_cuda_graphs(unset, _cuda_model(), None).cuda_graphs is False
    assert resolve_cuda_graphs(unset, _cuda_model(shards=2), _store()).cuda_graphs is False
    compiled = RunnerOptions(compile=True)
    assert resolve_cuda_graphs(compiled, _cuda_model(), _store()).cuda_graphs is False
    off = RunnerOptions(cuda_graphs=False)
    assert resolve_cuda_graphs(off, _cuda_model(), _store()).cuda_graphs is False
    cpu_model = SimpleNamespace(
        parameters=lambda: iter([torch.zeros(1)]), layout=SimpleNamespace(size=1)
    )
    assert resolve_cuda_graphs(unset, cpu_model, _store()).cuda_graphs is False  # type: ignore[arg-type]


@pytest.mark.spec("ENG-205")
def test_a_cpu_runner_left_unset_runs_eagerly(checkpoint: Path) -> None:
    """On the CPU the default resolves to off and no fixed-shape path is built, while
    cuda_graphs=True there is still refused. Kills a default that tries to capture on the
    CPU (every step would fail) or that silently accepts an impossible request."""
    runner = ModelRunner.from_model_dir(checkpoint, num_pages=PAGES, page_size=PAGE)
    assert runner.options.cuda_graphs is False
    assert runner._static is None
    with pytest.raises(InvalidRequest, match="cuda_graphs needs a model on a CUDA device"):
        ModelRunner.from_model_dir(
            checkpoint, num_pages=PAGES, page_size=PAGE, options=RunnerOptions(cuda_graphs=True)
        )


@pytest.mark.spec("ENG-205")
def test_enforce_eager_turns_graphs_off_for_llm_and_serve(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """enforce_eager=True (LLM's keyword, serve's --enforce-eager through the same table)
    reaches the engine's runner as cuda_graphs=False; left False, the runner's default. Kills
    an enforce_eager that is accepted and dropped."""
    seen: list[RunnerOptions | None] = []

    def recording(*args: object, **kwargs: Any) -> object:
        seen.append(kwargs.get("runner_options"))
        raise RuntimeError("stop after the options")

    import pagedkv.backend as backend

    monkeypatch.setattr(backend, "load_engine", recording)
    for eager, wanted in ((True, False), (False, None)):
        args = engine_args_from_kwargs(checkpoint, {"enforce_eager": eager})
        with pytest.raises(RuntimeError, match="stop after"):
            engine_args.load_engine_from_args(args)
        options = seen[-1]
        assert options is not None
        assert options.cuda_graphs is wanted
    assert EngineArgs(enforce_eager=True).runner_options() == RunnerOptions(cuda_graphs=False)
    from pagedkv.entrypoints.cli.main import build_parser

    parsed = build_parser().parse_args(["serve", "--model", str(checkpoint), "--enforce-eager"])
    assert parsed.enforce_eager is True


@pytest.mark.spec("ENG-206")
def test_capture_sizes_are_powers_of_two_up_to_the_largest_batch() -> None:
    """1, 2, 4, ... below the largest batch and the largest itself; a batch pads to the
    smallest size that holds it, none past the largest. Kills padding to a size that cannot
    hold the batch, a largest batch left out when it is not a power of two, or sizes past it."""
    assert capture_sizes(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert capture_sizes(48) == (1, 2, 4, 8, 16, 32, 48)
    assert capture_sizes(1) == (1,)
    sizes = capture_sizes(48)
    assert [padded_size(b, sizes) for b in (1, 3, 5, 16, 17, 33, 48)] == [1, 4, 8, 16, 32, 48, 48]
    assert padded_size(49, sizes) is None
    with pytest.raises(InvalidRequest, match=">= 1"):
        capture_sizes(0)


def _generate(runner: ModelRunner) -> list[list[int]]:
    engine = ReferenceBackend().create_engine(runner, EngineConfig(page_size=PAGE, num_pages=PAGES))
    return [list(o.token_ids) for o in run_to_completion(engine, PROMPTS, PARAMS)]


def _static_runner(
    checkpoint: Path, *, cuda_graphs: bool
) -> tuple[ModelRunner, Callable[[], StaticDecode]]:
    model = load_model(checkpoint)
    store = TorchPagedStore(
        StoreConfig(
            num_layers=model.config.num_hidden_layers,
            num_kv_heads=model.config.num_key_value_heads,
            head_dim=model.config.head_dim,
            page_size=PAGE,
            num_pages=PAGES,
        )
    )

    def static(built: Qwen3ForCausalLM) -> StaticDecode:
        return StaticDecode(
            built, store, max_batch=6, max_width=512, cuda_graphs=cuda_graphs, compile=False
        )

    runner = ModelRunner(
        model, partial(PagedStepAttention.prepare, store), store, static_decode=static
    )

    def made() -> StaticDecode:
        assert runner._static is not None
        return runner._static

    return runner, made


@pytest.mark.spec("ENG-206")
def test_padded_rows_change_no_real_row(checkpoint: Path) -> None:
    """Run eagerly on the CPU with a largest batch of 6: five sequences decode padded to 6
    (a size that is no power of two), and every token is the ordinary path's. Kills padding
    rows that write another sequence's slot or leak into a real row's logits."""
    runner, static = _static_runner(checkpoint, cuda_graphs=False)
    ordinary = ModelRunner.from_model_dir(checkpoint, num_pages=PAGES, page_size=PAGE)
    assert _generate(runner) == _generate(ordinary)
    assert {rows for rows, _ in static().shapes} <= set(capture_sizes(6))
    assert 6 in {rows for rows, _ in static().shapes}


@pytest.mark.spec("ENG-206")
def test_every_capture_of_a_runner_shares_one_pool(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in capture (the step run eagerly) records the pool each capture is given: one
    pool, made once, for every shape. Kills a pool per graph (each graph then holds its own
    copy of every temporary)."""
    pools: list[object] = []
    made: list[object] = []

    def captured(
        step: Callable[[], None], device: torch.device, pool: object
    ) -> Callable[[], None]:
        pools.append(pool)
        step()
        return step

    def new_pool() -> object:
        made.append(object())
        return made[-1]

    monkeypatch.setattr(static_decode, "captured", captured)
    monkeypatch.setattr(static_decode, "capture_pool", new_pool)
    runner, static = _static_runner(checkpoint, cuda_graphs=True)
    ordinary = ModelRunner.from_model_dir(checkpoint, num_pages=PAGES, page_size=PAGE)
    assert _generate(runner) == _generate(ordinary)
    assert len(static().shapes) == len(pools) > 1
    assert len(made) == 1
    assert all(pool is made[0] for pool in pools)
