"""The benchmark's machine limits, its thread default, the CUDA run and the vLLM peer's
refusals, without running a workload."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fake_vllm import fake_vllm_interpreter, small_peer

from pagedkv.bench import cli, limits
from pagedkv.bench.machine import physical_cores, usable_cores
from pagedkv.bench.requests import BenchRequest
from pagedkv.bench.run import RunResult
from pagedkv_bench import peers, vllm_peer, vllm_worker
from pagedkv_bench.peers import Row, rows


def test_the_read_bound_is_the_best_of_the_float32_kernels() -> None:
    bandwidth = limits.read_bandwidth(side=512, repeats=1)
    onednn = {"fp32_gemv_onednn"} if torch.backends.mkldnn.is_available() else set()  # type: ignore[no-untyped-call]
    assert set(bandwidth.kernels) == {"fp32_gemv", "sum", "copy", *onednn}
    assert bandwidth.tensor_bytes == 512 * 512 * 4
    assert bandwidth.best == max(bandwidth.kernels.values()) > 0
    assert bandwidth.kernels[bandwidth.best_kernel] == bandwidth.best


def test_gemm_peak_counts_two_operations_per_multiply_add() -> None:
    assert limits.gemm_peak_flops(side=64, repeats=1) > 0
    assert limits.gemm_peak_flops(torch.bfloat16, side=64, repeats=1) > 0


def test_gemm_peak_is_the_faster_of_mkl_and_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    """The peak is the machine's: whichever library's product is faster sets it."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        pytest.skip("this torch has no oneDNN: torch.mm alone is timed")
    for mkl_s, onednn_s in ((2.0, 1.0), (1.0, 4.0)):
        times = iter((mkl_s, onednn_s))
        monkeypatch.setattr(
            limits, "fastest", lambda kernel, repeats, device, times=times: next(times)
        )
        assert limits.gemm_peak_flops(side=8) == 2.0 * 8**3 / min(mkl_s, onednn_s)


def test_threads_default_to_the_physical_cores() -> None:
    args = cli.build_parser().parse_args([])
    assert args.threads is None  # resolved to physical_cores() by the run
    assert 1 <= physical_cores() <= usable_cores()


def test_cuda_is_skipped_with_a_reason_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the CUDA run would run")
    assert cli.main(["--device", "cuda", "--out", "unused"]) == 0
    assert "CUDA is not available" in capsys.readouterr().err


def test_vllm_without_its_interpreter_is_unavailable_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(vllm_peer.PYTHON_ENV, str(tmp_path / "no-python"))
    with pytest.raises(vllm_peer.PeerUnavailable, match="make vllm-install"):
        run_one_row(tmp_path)


def run_one_row(model_dir: Path) -> RunResult:
    """One small batch row on the vLLM peer, with the peers' step budget."""
    with small_peer(model_dir) as peer:
        return peer.run([BenchRequest((1, 2, 3), 4), BenchRequest((4, 5, 6), 4)])


def test_the_peer_table_has_the_issue_rows() -> None:
    assert [r.name for r in rows()] == [
        "fp32_decode",
        "fp32_bs8",
        "fp32_bs32",
        "fp32_decode_long",
        "bf16_decode",
        "bf16_bs8",
        "bf16_bs32",
        "bf16_decode_long",
    ]
    assert Row("float32", 1).metric == "decode_tokens_per_s"
    assert Row("bfloat16", 8).metric == "output_tokens_per_s"


class _CachingLLM:
    """A stand-in for vLLM's ``LLM`` with a prefix cache: it records, per ``generate``, how many
    of its prompts were already cached."""

    def __init__(self, clears: bool = True) -> None:
        self.cached: set[tuple[int, ...]] = set()
        self.hits: list[int] = []
        self.clears = clears

    def reset_prefix_cache(self) -> bool:
        if self.clears:
            self.cached.clear()
        return self.clears

    def generate(
        self, prompts: list[dict[str, list[int]]], params: list[dict[str, int]], use_tqdm: bool
    ) -> list[object]:
        ids = [tuple(p["prompt_token_ids"]) for p in prompts]
        self.hits.append(sum(i in self.cached for i in ids))
        self.cached.update(ids)
        return [
            SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0] * p["max_tokens"])])
            for p in params
        ]


@pytest.mark.spec("SRV-047")
@pytest.mark.parametrize("kind", ["batch", "decode"])
def test_a_peer_is_timed_from_an_empty_prefix_cache(kind: str) -> None:
    """SRV-047: after the warm-up, no timed call finds a prompt in vLLM's prefix cache."""
    llm = _CachingLLM()
    row = {
        "kind": kind,
        "requests": [[[1, 2, 3], 4], [[5, 6, 7], 4]][: 2 if kind == "batch" else 1],
    }
    figures = vllm_worker._row(llm, dict, row)
    assert figures["wall_s"] >= 0
    assert len(llm.hits) >= 2  # the warm-up and at least one timed call
    assert llm.hits[1:] == [0] * (len(llm.hits) - 1)


@pytest.mark.spec("SRV-047")
def test_a_peer_that_cannot_clear_its_prefix_cache_is_not_timed() -> None:
    row = {"kind": "batch", "requests": [[[1, 2, 3], 4]]}
    with pytest.raises(RuntimeError, match="prefix cache"):
        vllm_worker._row(_CachingLLM(clears=False), dict, row)


@pytest.mark.spec("SRV-048")
def test_vllm_is_given_the_peers_step_token_budget(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The budget goes to the worker, and the worker hands it to vLLM's ``LLM``."""
    made = fake_vllm_interpreter(monkeypatch, tmp_path)
    run_one_row(tmp_path)
    assert json.loads(made.read_text())["max_num_batched_tokens"] == peers.STEP_TOKENS == 4096


@pytest.mark.spec("SRV-048")
def test_pagedkv_runs_the_peers_rows_with_the_same_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    budgets: list[object] = []

    def fake_make_engine(runner: object, mode: str, num_pages: int, **kwargs: object) -> str:
        budgets.append(kwargs.get("max_num_batched_tokens"))
        return "engine"

    monkeypatch.setattr(peers, "make_engine", fake_make_engine)
    system = peers.pagedkv_system(None, 16)  # type: ignore[arg-type]
    assert system.name == peers.PAGEDKV
    assert system.make_engine() == "engine"
    assert budgets == [peers.STEP_TOKENS]


@pytest.mark.spec("SRV-048")
def test_the_peers_figures_record_the_step_budget() -> None:
    figures = peers.settings_and_rows("ck", 2, {"fp32_bs8": {"pagedkv": 1.0}})
    assert figures["step_tokens"] == peers.STEP_TOKENS
    assert figures["rows"] == {"fp32_bs8": {"pagedkv": 1.0}}
