"""The engine's continuing chunks through real attention: chunked prefill, prefix hits,
preemption and recycled pages on a tiny real Qwen3, token for token against transformers and
against solo runs.

The hash stand-in of ``suite_engine.py`` never calls a PagedStore and sees only each sequence's
last row, so it cannot certify the causal mask of a chunk that continues a cached context
(PST-011/012) or the K/V arithmetic behind it. Here every case runs the backend's own engine over
the backend's own model runner (and so its own store), and the recorder proves each case really
produced what it is about (continuing chunks, page tables out of order, preemptions).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import Backend
from pagedkv.testing.tiny_qwen3 import PRESETS, build_tiny_checkpoint, load_hf_reference

from .golden_harness import GoldenCheckpoints, hf_greedy
from .model_engine_harness import PlanRecorder, model_engine, run_all

#: The checkpoint the cases run: tied embeddings, GQA 2:1, two layers (a second layer makes
#: the first layer's outputs of every row, hence its causal mask, reach the logits).
PRESET = "tied-gqa2"
NEW_TOKENS = 8


def prompts(count: int, lengths: list[int], seed: int, prefix_len: int = 0) -> list[list[int]]:
    """``count`` prompts of the given lengths, sharing their first ``prefix_len`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    vocab = PRESETS[PRESET].vocab
    prefix = torch.randint(0, vocab, (prefix_len,), generator=gen).tolist()
    return [
        prefix + torch.randint(0, vocab, (lengths[i] - prefix_len,), generator=gen).tolist()
        for i in range(count)
    ]


def assert_matches_transformers(
    checkpoints: GoldenCheckpoints,
    got: list[list[int]],
    batch: list[list[int]],
    device: str = "cpu",
) -> None:
    expected = hf_greedy(checkpoints.reference(PRESET, "float32", device), batch, NEW_TOKENS)
    for i, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        assert ours == theirs, (
            f"prompt {i} (length {len(batch[i])}): engine {ours} != transformers {theirs}"
        )


def solo(backend: Backend, path: Path, prompt: list[int], device: str = "cpu") -> list[int]:
    """The prompt alone, in one prefill, on a fresh engine."""
    engine, _ = model_engine(backend, path, EngineConfig(page_size=16, num_pages=16), device)
    (out,) = run_all(engine, [prompt], NEW_TOKENS)
    return list(out.token_ids)


def tokens_of(outputs: list[RequestOutput]) -> list[list[int]]:
    return [list(o.token_ids) for o in outputs]


def assert_continuing_chunks(recorder: PlanRecorder) -> None:
    assert any(c.continues_context for c in recorder.chunks), (
        "no multi-row chunk continued a cached context: the case proves nothing"
    )


@pytest.mark.requires("engine", "model")
class EngineModelSuite:
    """Continuing chunks through the backend's real attention."""

    @pytest.mark.spec("ENG-031", "ENG-002", "PST-011", "PST-012")
    def test_chunked_prefill_matches_transformers(
        self, backend: Backend, golden_checkpoints: GoldenCheckpoints
    ) -> None:
        """Prompts of 23 and 13 tokens under a 5-token budget: later chunks continue 5, 10, 15
        and 20 cached positions, beside another request's decode rows."""
        path = golden_checkpoints.path(PRESET)
        batch = prompts(2, [23, 13], seed=1)
        config = EngineConfig(page_size=4, num_pages=32, max_num_batched_tokens=5)
        engine, recorder = model_engine(backend, path, config)
        got = tokens_of(run_all(engine, batch, NEW_TOKENS))
        assert_continuing_chunks(recorder)
        assert max(sum(c.num_rows for c in step) for step in recorder.steps) <= 5
        assert_matches_transformers(golden_checkpoints, got, batch)
        assert got == [solo(backend, path, p) for p in batch]

    @pytest.mark.spec("ENG-020", "ENG-026", "PST-011")
    def test_suffix_after_a_prefix_hit_matches_transformers(
        self, backend: Backend, golden_checkpoints: GoldenCheckpoints
    ) -> None:
        """Three prompts share 12 tokens (3 pages): the first computes them, the others hit
        them and compute only their 3- and 6-token suffixes over the cached context."""
        path = golden_checkpoints.path(PRESET)
        batch = prompts(3, [14, 15, 18], seed=2, prefix_len=12)
        engine, recorder = model_engine(backend, path, EngineConfig(page_size=4, num_pages=32))
        outputs = run_all(engine, batch, NEW_TOKENS, stagger=3)
        assert [o.metrics.cached_tokens for o in outputs] == [0, 12, 12]
        assert_continuing_chunks(recorder)
        got = tokens_of(outputs)
        assert_matches_transformers(golden_checkpoints, got, batch)
        assert got[1:] == [solo(backend, path, p) for p in batch[1:]]

    @pytest.mark.spec("ENG-032", "ENG-015", "PST-011")
    def test_preemption_and_recompute_match_transformers(
        self, backend: Backend, golden_checkpoints: GoldenCheckpoints
    ) -> None:
        """Four requests in a pool too small for all: the newest are preempted, and recomputed
        from their own cached pages (a suffix chunk over a cached context)."""
        path = golden_checkpoints.path(PRESET)
        batch = prompts(4, [11, 10, 9, 13], seed=3, prefix_len=2)
        config = EngineConfig(page_size=4, num_pages=12, max_num_seqs=4)
        engine, recorder = model_engine(backend, path, config)
        outputs = run_all(engine, batch, NEW_TOKENS)
        assert engine.stats().preemptions > 0
        assert engine.stats().pages_in_use == 0
        assert_matches_transformers(golden_checkpoints, tokens_of(outputs), batch)
        if not any(c.continues_context for c in recorder.chunks):
            pytest.skip("the engine recomputed preempted requests without a continuing chunk")

    @pytest.mark.spec("PST-014", "ENG-002")
    def test_recycled_pages_out_of_order_match_transformers(
        self, backend: Backend, golden_checkpoints: GoldenCheckpoints
    ) -> None:
        """A first wave of requests finishes and its pages return to the pool; the second wave
        runs on recycled pages whose page tables are not ascending, and whose last pages keep
        stale K/V of the first wave past each context."""
        path = golden_checkpoints.path(PRESET)
        first = prompts(3, [21, 9, 14], seed=4)
        second = prompts(3, [19, 7, 16], seed=5)
        config = EngineConfig(page_size=4, num_pages=20, enable_prefix_caching=False)
        engine, recorder = model_engine(backend, path, config)
        run_all(engine, first, NEW_TOKENS)
        wave = len(recorder.steps)
        got = tokens_of(run_all(engine, second, NEW_TOKENS))
        assert_matches_transformers(golden_checkpoints, got, second)
        later = [c.pages for step in recorder.steps[wave:] for c in step]
        if all(list(p) == sorted(p) for p in later):
            pytest.skip(
                "the backend handed out only ascending page tables; the store suite "
                "checks other orders directly"
            )

    @pytest.mark.spec("ENG-034")
    def test_sequences_never_pass_the_models_trained_positions(
        self, backend: Backend, tmp_path: Path
    ) -> None:
        """A checkpoint trained for 32 positions under an engine allowing 512: a request that
        would pass position 32 is refused at add_request, one that ends exactly there runs."""
        spec = dataclasses.replace(PRESETS[PRESET], max_position_embeddings=32)
        path = build_tiny_checkpoint(spec, tmp_path / "short")
        config = EngineConfig(page_size=4, num_pages=64, max_model_len=512)
        engine, _ = model_engine(backend, path, config)
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        with pytest.raises(InvalidRequest):
            engine.add_request(list(range(27)), params)  # 33 positions
        assert not engine.has_unfinished_requests()
        (out,) = run_all(engine, [list(range(26))], 6)
        assert len(out.token_ids) == 6
        reference = load_hf_reference(path)
        assert list(out.token_ids) == hf_greedy(reference, [list(range(26))], 6)[0]

    @pytest.mark.requires("cuda")
    @pytest.mark.spec("ENG-031", "ENG-020", "GLD-023")
    def test_continuing_chunks_on_cuda(
        self, backend: Backend, golden_checkpoints: GoldenCheckpoints
    ) -> None:
        """Chunked prefill and a prefix hit on a CUDA runner, against transformers on CUDA."""
        if not torch.cuda.is_available():
            pytest.skip("CUDA is not available on this machine")
        path = golden_checkpoints.path(PRESET)
        batch = prompts(3, [23, 15, 18], seed=6, prefix_len=12)
        config = EngineConfig(page_size=4, num_pages=32, max_num_batched_tokens=5)
        engine, recorder = model_engine(backend, path, config, device="cuda")
        got = tokens_of(run_all(engine, batch, NEW_TOKENS, stagger=2))
        assert_continuing_chunks(recorder)
        assert_matches_transformers(golden_checkpoints, got, batch, device="cuda")
