"""A step's plan staged through persistent buffers, and prepared without reading the device back
(ENG-224..226, PST-051..053), on the CPU: the device is the CPU itself, or ``meta`` where the
test needs a device that holds no values (any read of one fails, and is counted)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from op_watch import OpWatch, tensors_of

from pagedkv.accel.cuda.staging import PlanStaging
from pagedkv.accel.static_decode import capture_sizes
from pagedkv.backend import load_engine
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.runner_options import RunnerOptions
from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import PageCopy, StoreConfig
from pagedkv.model.step_attention import RecomputeStepAttention
from pagedkv.plan import AttentionBatch, SeqChunk, StepPlan
from pagedkv.plan_builders import build_paged_plan, build_recompute_plan
from pagedkv.store.paged_store import TorchPagedStore
from pagedkv.testing.tiny_qwen3 import PRESETS, build_tiny_checkpoint, one_torch_thread

PAGE = 4
NUM_PAGES = 64


def _host(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


class DeviceReads(OpWatch):
    """Counts the ops that bring a value of a tensor off the host back to it: a scalar read
    (``item``, ``int()``, a comparison in Python) or a copy to the CPU (``tolist``, ``cpu()``,
    ``.to("cpu")``). Each is counted before it runs, so a read that fails (on ``meta``) counts
    too."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def before(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        name = str(func.overloadpacket.__name__)
        tensors = tensors_of(args)
        if name == "_local_scalar_dense" and tensors and not _host(tensors[0]):
            self.reads.append(name)
        elif name == "_to_copy" and tensors and not _host(tensors[0]):
            target = kwargs.get("device")
            if target is not None and torch.device(target).type == "cpu":
                self.reads.append(name)
        elif name == "copy_" and len(tensors) >= 2 and _host(tensors[0]) and not _host(tensors[1]):
            self.reads.append(name)


class HostToDeviceCopies(OpWatch):
    """Counts copies of host tensors to another device."""

    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def before(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        name = str(func.overloadpacket.__name__)
        tensors = tensors_of(args)
        if name == "_to_copy" and tensors and _host(tensors[0]):
            target = kwargs.get("device")
            if target is not None and torch.device(target).type != "cpu":
                self.copies += 1
        elif name == "copy_" and len(tensors) >= 2 and not _host(tensors[0]) and _host(tensors[1]):
            self.copies += 1


@st.composite
def chunk_lists(draw: st.DrawFn) -> tuple[list[SeqChunk], list[PageCopy]]:
    """One to six sequences, decodes and chunks mixed, each over distinct pages covering its
    context (a few spare ones past it), and zero to two page copies."""
    free = list(range(NUM_PAGES))
    chunks = []
    for _ in range(draw(st.integers(1, 6))):
        start = draw(st.integers(0, 20))
        n = draw(st.sampled_from([1, 1, 2, 5]))
        need = -(-(start + n) // PAGE) + draw(st.integers(0, 2))
        pages = tuple(draw(st.permutations(free))[:need])
        free = [p for p in free if p not in pages]
        tokens = tuple(draw(st.lists(st.integers(0, 999), min_size=n, max_size=n)))
        chunks.append(SeqChunk(tokens, start, pages, all_logits=draw(st.booleans())))
    copies = [
        PageCopy(draw(st.integers(0, NUM_PAGES - 1)), draw(st.integers(0, NUM_PAGES - 1)))
        for _ in range(draw(st.integers(0, 2)))
    ]
    return chunks, copies


def _tensors(plan: StepPlan) -> dict[str, torch.Tensor | None]:
    batch = plan.attention
    return {
        "input_ids": plan.input_ids,
        "positions": plan.positions,
        "logits_indices": plan.logits_indices,
        "page_copies": plan.page_copies,
        "query_start": batch.query_start,
        "context_lens": batch.context_lens,
        "page_tables": batch.page_tables,
        "slot_mapping": batch.slot_mapping,
    }


def _same(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> None:
    assert a.keys() == b.keys()
    for name, x in a.items():
        y = b[name]
        assert (x is None) == (y is None), name
        if x is not None and y is not None:
            assert x.dtype == y.dtype == torch.int64, name
            assert x.shape == y.shape, name
            assert torch.equal(x, y), name


#: One staging for every example of the property below: its buffers persist across plans, as a
#: scheduler's do, so the property also sees plans staged over the leftovers of bigger ones.
_SHARED = PlanStaging("cpu", capacity=8)


@pytest.mark.spec("ENG-224")
@settings(max_examples=120, deadline=None)
@given(drawn=chunk_lists())
def test_staged_plans_equal_the_builders_without_staging(
    drawn: tuple[list[SeqChunk], list[PageCopy]],
) -> None:
    """Every tensor of a plan built through a persistent staging (v1 with its copies, and v0)
    equals the plain builder's, and so does its host copy, which lies in the host buffer. Kills
    parts written at the wrong offset or cut at the wrong lengths, the buffer of a previous,
    bigger plan read past this one's end, and a host copy left out or not the host buffer's."""
    chunks, copies = drawn
    plain = build_paged_plan(chunks, PAGE, "cpu", copies)
    staged = build_paged_plan(chunks, PAGE, "cpu", copies, _SHARED)
    _same(_tensors(plain), _tensors(staged))
    host = staged.attention.host
    assert host is not None
    _same(
        {k: v for k, v in _tensors(plain).items() if k in ("query_start", "page_tables")},
        {"query_start": host.query_start, "page_tables": host.page_tables},
    )
    for tensor in (host.context_lens, host.slot_mapping):
        assert tensor is not None
        assert tensor.untyped_storage().data_ptr() == _SHARED.host_buffer.data_ptr()
    assert staged.input_ids.untyped_storage().data_ptr() == _SHARED.device_buffer.data_ptr()
    whole = [SeqChunk(c.token_ids, 0) for c in chunks]
    _same(
        _tensors(build_recompute_plan(whole, "cpu")),
        _tensors(build_recompute_plan(whole, "cpu", _SHARED)),
    )


@pytest.mark.spec("ENG-224")
def test_the_buffers_grow_geometrically_and_are_reused() -> None:
    """A plan that fits reuses the buffers (the same storage, step after step); one that does
    not at least doubles them once; a smaller plan after it keeps the grown buffers. A
    scheduler keeps one staging. Kills a staging that allocates per step, grows to the exact
    size (one growth per larger step), or shrinks back."""
    staging = PlanStaging("cpu", capacity=16)
    small = [torch.arange(5), torch.arange(4) + 10, torch.arange(2) + 20]
    first = staging.stage(small)
    buffer = staging.device_buffer
    second = staging.stage(small)
    for staged in (first, second):
        for got, part in zip(staged.device, small, strict=True):
            assert torch.equal(got, part)
        for part in staged.device:
            assert part.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    assert staging.growths == 0
    assert staging.capacity == 16
    staging.stage([torch.arange(17)])  # just over: at least doubles
    assert staging.growths == 1
    assert staging.capacity == 32
    grown = staging.device_buffer
    staging.stage([torch.arange(30)])  # fits the doubled buffer: no second growth
    staging.stage(small)
    assert staging.growths == 1
    assert staging.capacity == 32
    assert staging.device_buffer is grown
    staging.stage([torch.arange(100)])  # far over: exactly what it needs, at least double
    assert staging.growths == 2
    assert staging.capacity == 100

    from pagedkv.engine.sched.recompute import RecomputeScheduler

    scheduler = RecomputeScheduler(EngineConfig(mode="v0"), frozenset(), 64)
    assert scheduler.staging_for(torch.device("cpu")) is scheduler.staging_for(torch.device("cpu"))


def test_a_staging_refuses_what_it_cannot_stage() -> None:
    with pytest.raises(InvalidRequest, match="at least 1"):
        PlanStaging("cpu", capacity=0)
    with pytest.raises(InvalidRequest, match="integers"):
        PlanStaging("cpu", torch.float32)
    with pytest.raises(InvalidRequest, match="1-D host tensor"):
        PlanStaging("cpu").stage([torch.zeros(2, 2, dtype=torch.int64)])
    with pytest.raises(InvalidRequest, match="cannot build a plan"):
        build_paged_plan([SeqChunk((1,), 0, (0,))], PAGE, "cpu", (), PlanStaging("meta"))


def _meta_store() -> TorchPagedStore:
    return TorchPagedStore(StoreConfig(2, 2, 8, PAGE, NUM_PAGES, device="meta"))


CHUNKS = [
    SeqChunk((5, 6, 7, 8, 9), 3, (4, 9)),  # a chunk continuing a cached prefix
    SeqChunk((1,), 6, (2, 7)),  # a decode
    SeqChunk((3, 3), 0, (11,), all_logits=True),
]


@pytest.mark.spec("PST-051")
@pytest.mark.spec("ENG-225")
def test_preparing_a_step_reads_nothing_back_from_the_device() -> None:
    """A plan built for a device that holds no values (``meta``) is prepared by the reference
    store, the Triton store and v0's layout without one read of a device value: the checks
    read the plan's host copy. Kills a ``prepare`` that reads the device's tensors (a
    ``tolist`` of the offsets or the lengths, an ``aminmax`` of the slots or the pages, a copy
    of the tables to the CPU), and a builder that leaves the host copy out."""
    staging = PlanStaging("meta")
    store = _meta_store()
    from pagedkv.accel.cuda.triton_store import TritonPagedStore

    for prepare in (store.prepare, TritonPagedStore(store).prepare):
        plan = build_paged_plan(CHUNKS, PAGE, "meta", (), staging)
        assert plan.input_ids.device.type == "meta"
        with DeviceReads() as mode:
            prepare(plan.attention)
        assert mode.reads == []
    v0 = build_recompute_plan([SeqChunk((1, 2, 3), 0), SeqChunk((4,), 0)], "meta", staging)
    with DeviceReads() as mode:
        RecomputeStepAttention.prepare(v0)
    assert mode.reads == []


def test_the_read_counter_sees_every_kind_of_read() -> None:
    """The counter of the test above counts a ``tolist``, an ``item`` and a copy to the CPU of
    a device tensor, and nothing on host tensors."""
    device = torch.arange(4, device="meta")
    with DeviceReads() as mode:
        for read in (device.tolist, device[0].item, device.cpu):
            with pytest.raises((NotImplementedError, RuntimeError)):
                read()
        torch.arange(4).tolist()
    assert mode.reads == ["_to_copy", "_local_scalar_dense", "_to_copy"]


@pytest.mark.spec("PST-051")
def test_the_checks_still_refuse_a_bad_batch_from_its_host_copy() -> None:
    """A plan whose pages lie past the pool is refused from its host copy, on a device that
    holds no values. Kills checks skipped where a host copy exists."""
    plan = build_paged_plan([SeqChunk((1, 2), 0, (NUM_PAGES,))], PAGE, "meta")
    with pytest.raises(InvalidRequest, match="outside"):
        _meta_store().prepare(plan.attention)


@pytest.mark.spec("PST-053")
def test_a_host_copy_not_shaped_as_the_batch_is_refused() -> None:
    """A host copy of other shapes, or not on the CPU, is refused before any value is read.
    Kills a check that trusts any host copy (a batch checked on another batch's values)."""
    plan = build_paged_plan(CHUNKS, PAGE, "cpu", (), PlanStaging("cpu"))
    batch = plan.attention
    host = batch.host
    assert host is not None
    store = TorchPagedStore(StoreConfig(2, 2, 8, PAGE, NUM_PAGES))
    store.prepare(batch)
    shorter = AttentionBatch(
        host.query_start[:-1], host.context_lens[:-1], host.page_tables, host.slot_mapping
    )
    off_host = AttentionBatch(
        host.query_start.to("meta"), host.context_lens, host.page_tables, host.slot_mapping
    )
    no_slots = AttentionBatch(host.query_start, host.context_lens, host.page_tables, None)
    for wrong in (shorter, off_host, no_slots):
        bad = AttentionBatch(
            batch.query_start, batch.context_lens, batch.page_tables, batch.slot_mapping, wrong
        )
        with pytest.raises(InvalidRequest, match="host copy"):
            store.prepare(bad)


@pytest.mark.spec("PST-052")
def test_the_triton_store_moves_its_metadata_in_one_copy() -> None:
    """The Triton store's ``prepare`` of a plan on a device copies host values to it once.
    Kills a metadata moved tensor by tensor (five copies and more)."""
    from pagedkv.accel.cuda.triton_store import TritonPagedStore

    store = TritonPagedStore(_meta_store())
    plan = build_paged_plan(CHUNKS, PAGE, "meta", (), PlanStaging("meta"))
    with HostToDeviceCopies() as mode:
        metadata = store.prepare(plan.attention)
    assert mode.copies == 1
    assert metadata.page_tables.device.type == "meta"
    assert metadata.page_tables.shape == (3, 2)


@pytest.mark.spec("ENG-224")
def test_a_plan_moves_to_its_device_in_one_copy() -> None:
    """Building a plan for a device through a staging copies host values to it once, page
    tables, slots and copies included; without a staging, once too. Kills a plan moved
    tensor by tensor."""
    for staging in (PlanStaging("meta"), None):
        with HostToDeviceCopies() as mode:
            build_paged_plan(CHUNKS, PAGE, "meta", [PageCopy(1, 2)], staging)
        assert mode.copies == 1


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with one_torch_thread():
        yield build_tiny_checkpoint(PRESETS["tied-gqa2"], tmp_path_factory.mktemp("tied"))


@pytest.mark.spec("ENG-226")
def test_an_engines_runner_runs_fixed_shapes_up_to_its_max_num_seqs(checkpoint: Path) -> None:
    """An engine's runner with fixed-shape decode steps takes batches up to the engine's
    ``max_num_seqs`` (past 256 too), powers of two and ``max_num_seqs`` itself; a runner's own
    ``max_decode_batch`` wins, over the Triton store's fixed-shape path too; a runner built
    alone keeps 256. Kills the fixed 256 of either path."""
    for max_num_seqs, options, wanted in (
        (48, RunnerOptions(compile=True), 48),
        (300, RunnerOptions(compile=True), 300),
        (48, RunnerOptions(compile=True, max_decode_batch=8), 8),
    ):
        config = EngineConfig(page_size=PAGE, num_pages=NUM_PAGES, max_num_seqs=max_num_seqs)
        engine = load_engine(checkpoint, config, runner_options=options)
        runner = engine.runner
        assert isinstance(runner, ModelRunner)
        assert runner._static is not None
        assert runner._static.batch_sizes == capture_sizes(wanted)
    from pagedkv.accel.cuda.attention_choice import static_decode_for
    from pagedkv.accel.cuda.triton_store import TritonPagedStore
    from pagedkv.model.loader import load_model

    model = load_model(checkpoint)
    cfg = model.config
    shape = StoreConfig(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, PAGE, 8)
    triton = static_decode_for(
        model, TritonPagedStore(TorchPagedStore(shape)), RunnerOptions(max_decode_batch=48)
    )
    assert triton.batch_sizes == capture_sizes(48)
    alone = ModelRunner.from_model_dir(
        checkpoint, num_pages=NUM_PAGES, page_size=PAGE, options=RunnerOptions(compile=True)
    )
    assert alone._static is not None
    assert alone._static.max_batch == 256
    with pytest.raises(InvalidRequest, match="max_decode_batch"):
        RunnerOptions(max_decode_batch=0)


def _storages_of_plans(engine: Any) -> list[tuple[int, int]]:
    """Runs two requests on ``engine``; for each plan, the storage of its token ids and of its
    scheduler's staging's device buffer."""
    from pagedkv.engine.llm import run_to_completion
    from pagedkv.engine.params import SamplingParams

    seen: list[tuple[int, int]] = []
    execute = engine.runner.execute

    def recording(plan: StepPlan) -> torch.Tensor:
        staging = engine.scheduler.staging_for(plan.input_ids.device)
        buffer = staging.device_buffer.untyped_storage().data_ptr()
        seen.append((plan.input_ids.untyped_storage().data_ptr(), buffer))
        return execute(plan)  # type: ignore[no-any-return]

    engine.runner.execute = recording
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    run_to_completion(engine, [[1, 2, 3], [4, 5, 6, 7, 8]], params)
    return seen


@pytest.mark.spec("ENG-224")
def test_an_engines_plans_are_views_of_its_schedulers_staging(checkpoint: Path) -> None:
    """Every plan an engine runs (prefill and decode steps, v1 and v0) is a view of its
    scheduler's one staging, whose device buffer stays the same storage step after step. Kills
    a scheduler that builds its plans without the staging, or a staging made per step."""
    for mode in ("v1", "v0"):
        config = EngineConfig(page_size=PAGE, num_pages=NUM_PAGES, mode=mode)
        seen = _storages_of_plans(load_engine(checkpoint, config))
        assert len(seen) >= 4
        assert {plan for plan, _ in seen} == {seen[0][1]}
        assert {buffer for _, buffer in seen} == {seen[0][1]}


class MadeOnADevice:
    """Counts tensors made from Python values straight on a device, ``torch.tensor(values,
    device=...)``: a host-to-device copy each that no dispatch mode sees (the copy is made
    below it). Installed on ``torch.tensor`` by :meth:`install`."""

    def __init__(self) -> None:
        self.copies = 0
        self._tensor = torch.tensor

    def install(self, monkeypatch: pytest.MonkeyPatch) -> MadeOnADevice:
        def tensor(*args: Any, **kwargs: Any) -> torch.Tensor:
            device = kwargs.get("device")
            if device is not None and torch.device(device).type != "cpu":
                self.copies += 1
            return self._tensor(*args, **kwargs)

        monkeypatch.setattr(torch, "tensor", tensor)
        return self


@pytest.mark.spec("PST-054")
def test_the_reference_store_moves_its_layout_in_one_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reference store's ``prepare`` of a plan on a device (decode, continuing chunk and
    whole-prompt groups) copies host values to it once, and v0's layout once too; on a CPU
    pool nothing is copied. Kills a group tensor (its rows, slots or lengths) built with a
    ``torch.tensor(..., device=device)`` of its own, or moved with a ``.to(device)`` of its
    own: a copy each."""
    staging = PlanStaging("meta")
    plan = build_paged_plan(CHUNKS, PAGE, "meta", (), staging)
    made = MadeOnADevice().install(monkeypatch)
    with HostToDeviceCopies() as mode:
        metadata = _meta_store().prepare(plan.attention)
    assert mode.copies + made.copies == 1
    groups = metadata.layout.groups
    assert len(groups) == 3
    assert {g.kv_index.device.type for g in groups} == {"meta"}
    assert {g.rows.device.type for g in groups} == {"meta"}
    assert sum(g.mask is not None for g in groups) == 1  # the continuing chunk's tail
    assert all(g.mask is None or g.mask.device.type == "meta" for g in groups)
    v0 = build_recompute_plan([SeqChunk((1, 2, 3), 0), SeqChunk((4,), 0)], "meta", staging)
    made.copies = 0
    with HostToDeviceCopies() as mode:
        RecomputeStepAttention.prepare(v0)
    assert mode.copies + made.copies == 1
    cpu_plan = build_paged_plan(CHUNKS, PAGE, "cpu", (), PlanStaging("cpu"))
    made.copies = 0
    with HostToDeviceCopies() as mode:
        TorchPagedStore(StoreConfig(2, 2, 8, PAGE, NUM_PAGES)).prepare(cpu_plan.attention)
    assert mode.copies + made.copies == 0


@pytest.mark.spec("PST-054")
def test_a_layout_moved_in_one_copy_equals_the_one_built_on_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every group's rows, slots and lengths, packed into one copy and cut back into views,
    hold the values of the layout built on the host, and the masks made on the device have the
    host's shapes (padding masks their values too). The copy itself is made on the CPU here
    (the device is ``meta`` for the masks only). Kills views cut at the wrong offsets of the
    copy, or a mask made from the wrong group's lengths."""
    from pagedkv.store import one_copy, ragged_attention

    def on_the_cpu(parts: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, ...]:
        return one_copy.move_once(parts, torch.device("cpu"))

    tables = torch.tensor([[4, 9, 1], [2, 7, 0], [11, 0, 0], [3, 5, 0]])

    def slots_of(seqs: list[int], width: int) -> torch.Tensor:
        positions = torch.arange(width)
        return tables[seqs][:, positions // PAGE] * PAGE + positions % PAGE

    # Two decode groups (contexts 9 and 3, 2: apart), a continuing chunk, a whole prompt.
    starts, contexts = [0, 5, 6, 8, 9], [8, 9, 2, 3]
    host = ragged_attention.plan_attention(starts, contexts, slots_of, torch.device("cpu"))
    monkeypatch.setattr(ragged_attention, "move_once", on_the_cpu)
    moved = ragged_attention._moved(list(host.groups), torch.device("meta"))
    assert len(moved) == len(host.groups) >= 3
    for want, got in zip(host.groups, moved, strict=True):
        assert torch.equal(got.rows, want.rows)
        assert torch.equal(got.kv_index, want.kv_index)
        assert (got.context_lens is None) == (want.context_lens is None)
        if got.context_lens is not None and want.context_lens is not None:
            assert torch.equal(got.context_lens, want.context_lens)
        assert (got.mask is None) == (want.mask is None)
        if got.mask is not None and want.mask is not None:
            assert got.mask.shape == want.mask.shape
            if got.mask.device.type == "cpu":
                assert torch.equal(got.mask, want.mask)


@pytest.mark.spec("PST-055")
def test_copy_pages_from_the_plans_host_copy_reads_nothing_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fork step's page copies carry their host copy; ``copy_pages`` given it reads no
    value back from the device and moves the slots to copy once. Kills a plan without the host
    copy (the device's copies, read back by ``aminmax``/``tolist``), and a ``copy_pages``
    moving source and target slots in two copies."""
    plan = build_paged_plan(CHUNKS, PAGE, "meta", [PageCopy(1, 2), PageCopy(3, 5)])
    host = plan.page_copies_host
    assert host is not None
    assert host.device.type == "cpu"
    assert host.tolist() == [[1, 3], [2, 5]]
    assert plan.page_copies_on_host is host
    store = _meta_store()
    made = MadeOnADevice().install(monkeypatch)
    with DeviceReads() as reads, HostToDeviceCopies() as copies:
        store.copy_pages(host[0], host[1])
    assert reads.reads == []
    assert copies.copies + made.copies == 1
    cpu = build_paged_plan(CHUNKS, PAGE, "cpu", [PageCopy(1, 2)])
    assert cpu.page_copies_host is None
    assert cpu.page_copies_on_host is cpu.page_copies


@pytest.mark.spec("PST-055")
def test_copy_pages_still_refuses_bad_pages_from_the_host_copy() -> None:
    """Pages past the pool, a target named twice or also a source are refused from host
    tensors, on a device that holds no values. Kills checks skipped for host tensors."""
    store = _meta_store()
    for src, dst, match in (
        ([1], [NUM_PAGES], "outside"),
        ([-1], [2], "outside"),
        ([1, 3], [2, 2], "repeat or overlap"),
        ([1, 3], [3, 4], "repeat or overlap"),
        ([1, 3], [2], "source pages for"),
    ):
        with pytest.raises(InvalidRequest, match=match):
            store.copy_pages(torch.tensor(src), torch.tensor(dst))
