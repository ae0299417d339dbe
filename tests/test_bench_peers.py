"""The peers workload's repetitions (SRV-104): vLLM's worker stays up between runs, the
systems take turns in a rotating order, each row reports the median of its runs and each
ratio the median of the ratios within repetitions; the mixed workload's continuous-batching
baseline is paired the same way."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from fake_vllm import fake_vllm_interpreter, small_peer

from pagedkv.bench import hf_systems, mixed, pagedkv_system
from pagedkv.bench.context import BenchContext
from pagedkv.bench.hf_systems import HF_GENERATE_BATCH
from pagedkv.bench.requests import BenchRequest
from pagedkv.bench.results import WorkloadResult
from pagedkv_bench import peers, vllm_peer


@pytest.mark.spec("SRV-104")
def test_the_vllm_worker_stays_up_and_warms_each_row_up_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake_vllm_interpreter(monkeypatch, tmp_path)
    batch = [BenchRequest((1, 2), 3), BenchRequest((4, 5), 3)]
    decode = [BenchRequest((1, 2), 5)]
    with small_peer() as peer:
        assert peer.version == "0.0-fake"
        runs = [peer.run(batch), peer.run(batch), peer.run(decode), peer.run(decode)]
    assert all(r.tokens_per_s > 0 and r.output_tokens == 6 for r in runs[:2])
    assert all(r.decode_tokens_per_s > 0 and r.decode_tokens == (4,) for r in runs[2:])
    calls = (tmp_path / "calls.txt").read_text().split()
    # batch: warm-up, timed, timed; decode: warm-up, then (1 token, 5 tokens) twice.
    assert calls == ["2", "2", "2", "1", "1", "1", "1", "1"]


@pytest.mark.spec("SRV-104")
def test_a_failing_vllm_worker_is_unavailable_with_its_last_words(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake_vllm_interpreter(monkeypatch, tmp_path)
    monkeypatch.setenv("FAKE_VLLM_FAIL", "the fake engine broke")
    with small_peer() as peer, pytest.raises(vllm_peer.PeerUnavailable) as caught:
        peer.run([BenchRequest((1,), 2), BenchRequest((3,), 2)])
    assert "exited with 1" in str(caught.value)
    assert "the fake engine broke" in str(caught.value)


class _FakeSystem:
    """A system whose runs are logged in ``order``; each returns the next of ``rates``, over
    and over."""

    def __init__(self, name: str, order: list[str], rates: list[float]) -> None:
        self.name, self.order, self.rates = name, order, itertools.cycle(rates)

    def run(self, requests: object) -> SimpleNamespace:
        self.order.append(self.name)
        value = next(self.rates)
        return SimpleNamespace(decode_tokens_per_s=value, tokens_per_s=value)


def measure_fakes(
    monkeypatch: pytest.MonkeyPatch, peer_names: tuple[str, ...]
) -> tuple[dict[str, list[list[str]]], peers.Samples]:
    """The float32 rows over stand-ins of pagedkv (30, 10, 20 tokens/s, over and over),
    transformers (5, 7, 6) and each of ``peer_names`` (1, 3, 2): the runs of each row (each
    the systems in the order they ran), and the samples."""
    order: list[str] = []
    hf = _FakeSystem(peers.HF, order, [5.0, 7.0, 6.0])
    for name in ("load_runner", "load_hf_model", "warm_up", "make_engine"):
        monkeypatch.setattr(peers, name, lambda *a, **k: None)
    monkeypatch.setattr(peers, "HfGenerate", lambda model: hf)
    monkeypatch.setattr(
        peers,
        "pagedkv_system",
        lambda runner, num_pages: _FakeSystem(peers.PAGEDKV, order, [30.0, 10.0, 20.0]),
    )
    ctx = BenchContext(quick=False, threads=1, verbose=False)
    dtype_rows = [r for r in peers.rows() if r.dtype == "float32"]
    samples: peers.Samples = {r.name: {} for r in dtype_rows}
    fakes = [_FakeSystem(name, order, [1.0, 3.0, 2.0]) for name in peer_names]
    checkpoint = SimpleNamespace(path=Path("unused"))
    peers._measure_rows(ctx, WorkloadResult("peers"), checkpoint, dtype_rows, 100, samples, *fakes)  # type: ignore[arg-type]
    assert order.pop(0) == peers.HF  # the warm-up
    runs: dict[str, list[list[str]]] = {}
    systems = (peers.PAGEDKV, peers.HF, *peer_names)
    for row in dtype_rows:
        taking_part = sum(row.runs_on(s) for s in systems)
        repeats = max(peers.REPEATS, taking_part)
        runs[row.name] = [order[i * taking_part : (i + 1) * taking_part] for i in range(repeats)]
        del order[: repeats * taking_part]
    assert order == []
    return runs, samples


@pytest.mark.spec("SRV-104")
def test_the_systems_take_turns_and_each_row_reports_its_median(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runs, samples = measure_fakes(monkeypatch, (peers.VLLM,))
    for name, row_runs in runs.items():  # each system leads one repetition of every row
        assert len(row_runs) == peers.REPEATS
        assert (
            {run[0] for run in row_runs} == set(row_runs[0]) == {*(s for r in row_runs for s in r)}
        )
        assert all(len(samples[name][s]) == peers.REPEATS for s in row_runs[0])
    assert set(runs["fp32_bs8"][0]) == {peers.PAGEDKV, peers.HF, peers.VLLM}
    figures = peers.medians(samples)
    assert figures["fp32_bs8"] == {peers.PAGEDKV: 20.0, peers.HF: 6.0, peers.VLLM: 2.0}
    recorded = peers.settings_and_rows("ck", 1, figures, samples)
    assert recorded["repeats"] == peers.REPEATS
    assert recorded["samples"] == samples


@pytest.mark.spec("ENG-211", "ENG-213")
def test_with_llama_cpp_each_row_runs_once_per_system_and_each_leads_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Four systems over three repetitions could not each lead one: the rows with four run
    four times, the long row (no transformers) three. Catches a rotation that never lets a
    system lead, or transformers run on the long row."""
    runs, samples = measure_fakes(monkeypatch, (peers.VLLM, peers.LLAMA_CPP))
    four = {peers.PAGEDKV, peers.HF, peers.VLLM, peers.LLAMA_CPP}
    for name in ("fp32_decode", "fp32_bs8", "fp32_bs32"):
        assert len(runs[name]) == 4
        assert all(set(run) == four for run in runs[name])
        assert {run[0] for run in runs[name]} == four
        assert all(len(samples[name][s]) == 4 for s in four)
    long_runs = runs["fp32_decode_long"]
    assert len(long_runs) == 3
    assert all(set(run) == four - {peers.HF} for run in long_runs)
    assert {run[0] for run in long_runs} == four - {peers.HF}
    assert peers.HF not in samples["fp32_decode_long"]


@pytest.mark.spec("SRV-104")
def test_a_peer_ratio_is_the_median_of_the_ratios_within_repetitions() -> None:
    """A slow phase that falls on one repetition of both systems cancels in its ratio: the
    medians of each system's runs would give 68 / 69, the repetitions' ratios 1.23, 0.99 and
    1.03."""
    samples: peers.Samples = {r.name: {} for r in peers.rows()}
    samples["bf16_bs8"] = {peers.PAGEDKV: [87.0, 68.0, 63.0], peers.VLLM: [71.0, 69.0, 61.0]}
    result = WorkloadResult("peers")
    peers._ratios(result, samples)
    assert result.ratios["peers.bf16_bs8_pagedkv_vs_vllm_cpu"] == pytest.approx(63.0 / 61.0)
    assert peers.paired_ratio([2.0, 4.0], [1.0]) == 2.0  # only the repetitions both have
    assert math.isnan(peers.paired_ratio([2.0], []))


def run_mixed(
    monkeypatch: pytest.MonkeyPatch, batch_rates: list[float | None]
) -> tuple[WorkloadResult, list[int]]:
    """The full-mode mixed workload over stand-ins: pagedkv v1 at 500, 300 and 400 tokens/s
    by repetition, generate_batch at ``batch_rates`` (``None``: that run raises); the result
    and the warm-ups generate_batch got."""
    rates = {"pagedkv-v1": iter([500.0, 300.0, 400.0]), HF_GENERATE_BATCH: iter(batch_rates)}

    def fake_run(name: str) -> SimpleNamespace:
        value = next(rates[name]) if name in rates else 10.0
        if value is None:
            raise RuntimeError("continuous batching broke")
        return SimpleNamespace(tokens_per_s=value, ttft_s=(0.1,), summary=lambda: {})

    monkeypatch.setattr(mixed, "load_runner", lambda *a, **k: SimpleNamespace(model=None))
    monkeypatch.setattr(mixed, "load_hf_model", lambda *a, **k: None)
    monkeypatch.setattr(mixed, "warm_up", lambda *a, **k: None)
    monkeypatch.setattr(mixed, "make_engine", lambda *a, **k: None)
    monkeypatch.setattr(mixed.ModelRunner, "recompute", staticmethod(lambda model: None))
    monkeypatch.setattr(pagedkv_system, "run_engine", lambda engine, requests, name: fake_run(name))
    monkeypatch.setattr(hf_systems, "run_generate_static", lambda *a, **k: fake_run("static"))
    monkeypatch.setattr(mixed, "has_generate_batch", lambda model: True)
    warm_ups: list[int] = []

    def fake_batch(model: object, requests: list[object], **kwargs: object) -> SimpleNamespace:
        if len(requests) == 2:
            warm_ups.append(1)
            return fake_run("warm-up")
        return fake_run(HF_GENERATE_BATCH)

    monkeypatch.setattr(hf_systems, "run_generate_batch", fake_batch)
    ctx = BenchContext(quick=False, threads=1, verbose=False)
    result = mixed.run(ctx, SimpleNamespace(path=Path("unused")), 100)  # type: ignore[arg-type]
    return result, warm_ups


@pytest.mark.spec("SRV-104")
def test_the_mixed_continuous_batching_baseline_runs_in_every_repetition(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each repetition runs pagedkv v1 and transformers' generate_batch back to back, and the
    ratio is the median of the repetitions' ratios."""
    result, warm_ups = run_mixed(monkeypatch, [50.0, 60.0, 100.0])
    assert warm_ups == [1]
    assert result.figures["repetition_tokens_per_s"][HF_GENERATE_BATCH] == [50.0, 60.0, 100.0]
    # Ratios 10, 5 and 4: their median, where the medians' ratio would read 400 / 60.
    assert result.ratios["mixed.pagedkv_vs_hf_generate_batch"] == pytest.approx(5.0)


@pytest.mark.spec("SRV-104")
def test_a_continuous_batching_run_that_raises_ends_that_baseline_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The error is recorded, generate_batch leaves the later repetitions, the other systems
    run all three, and the ratio pairs the repetitions it has."""
    result, _ = run_mixed(monkeypatch, [50.0, None])
    assert "continuous batching broke" in result.errors[HF_GENERATE_BATCH]
    runs = result.figures["repetition_tokens_per_s"]
    assert runs[HF_GENERATE_BATCH] == [50.0]
    assert runs["pagedkv-v1"] == [500.0, 300.0, 400.0]
    assert result.ratios["mixed.pagedkv_vs_hf_generate_batch"] == pytest.approx(10.0)
