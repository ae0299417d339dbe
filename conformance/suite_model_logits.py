"""Model runner conformance tests of logits against transformers (specs/golden.md GLD-010..013),
on a tiny seeded Qwen3 checkpoint run by the backend's own ``create_model_runner``: a
cache-less (v0) plan and a paged (v1) prefill give every position's logits, the first decode
step over the cached prompt gives the next one's, and a prompt computed in chunks starting
mid-page beside another sequence's decodes gives every position's, within the float32
tolerance of transformers' eager forward on the same tokens; for the dense preset and every
Qwen3-MoE preset (GLD-041). Subclass
:class:`ModelLogitsSuite` to run these against a runner of yours.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from pagedkv.interfaces import Backend, ModelBackend, StepRunner
from pagedkv.plan import SeqChunk
from pagedkv.plan_builders import build_paged_plan, build_recompute_plan
from pagedkv.testing.tiny_qwen3 import FAMILY_PRESETS, PRESETS, preset_spec, reference_logits

from .golden_harness import GoldenCheckpoints

#: Max abs logit difference against transformers, float32 (GLD-010..GLD-012).
FP32_ATOL = 1e-4
#: Max abs logit difference against transformers run in the same 16-bit dtype (GLD-016).
HALF_ATOL = {"bfloat16": 1.0, "float16": 0.25}
#: Max abs logit difference of a 16-bit run against the float32 reference (GLD-016).
HALF_VS_FP32_ATOL = {"bfloat16": 1.5, "float16": 0.25}
#: Prompt lengths of the ragged batch: none is a multiple of 5, one of 16, one is 1.
PROMPT_LENGTHS = (13, 1, 32, 7)
#: The scaled-RoPE presets and a prompt length past each one's original context (GLD-032).
SCALED = sorted(n for n, s in FAMILY_PRESETS.items() if s.rope_scaling)
SCALED_LENGTHS = (13, 1, 60, 7)
#: The dense preset, and every Qwen3-MoE preset (GLD-041: the same checks).
MODELS = [sorted(PRESETS)[0], *sorted(n for n, s in FAMILY_PRESETS.items() if s.is_moe)]
#: Every preset and every family preset: what the CUDA checks run (GLD-017, GLD-046).
CUDA_PRESETS = [*sorted(PRESETS), *sorted(FAMILY_PRESETS)]


def prompts(vocab: int, lengths: Sequence[int] = PROMPT_LENGTHS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def page_tables(lengths: Sequence[int], page_size: int) -> list[tuple[int, ...]]:
    """Fresh pages for each sequence, in order, enough for ``length`` positions."""
    tables, first = [], 0
    for length in lengths:
        count = -(-length // page_size)
        tables.append(tuple(range(first, first + count)))
        first += count
    return tables


def split_rows(logits: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    out, row = [], 0
    for length in lengths:
        out.append(logits[row : row + length])
        row += length
    return out


@pytest.mark.requires("model")
class ModelLogitsSuite:
    """Logits of whole prompts and of the first decode step, against transformers."""

    def runner(
        self,
        backend: Backend,
        checkpoints: GoldenCheckpoints,
        preset: str,
        num_pages: int | None,
        page: int,
        dtype: str = "float32",
        device: str = "cpu",
    ) -> StepRunner:
        assert isinstance(backend, ModelBackend)
        path = str(checkpoints.path(preset, dtype))
        return backend.create_model_runner(
            path, num_pages=num_pages, page_size=page, dtype=dtype, device=device
        )

    @pytest.mark.spec("GLD-010", "GLD-041")
    @pytest.mark.parametrize("preset", MODELS)
    def test_a_v0_plan_gives_every_positions_logits(
        self, backend: Backend, golden_checkpoints: GoldenCheckpoints, preset: str
    ) -> None:
        """The ragged batch in one cache-less plan, every row's logits asked for."""
        self.check_v0_logits(backend, golden_checkpoints, preset, "cpu")

    @pytest.mark.spec("GLD-011", "GLD-012", "GLD-041")
    @pytest.mark.parametrize("preset", MODELS)
    @pytest.mark.parametrize("page_size", [1, 5, 16])
    def test_a_v1_prefill_and_the_first_decode_step(
        self, backend: Backend, golden_checkpoints: GoldenCheckpoints, page_size: int, preset: str
    ) -> None:
        """The ragged batch prefilled whole in one paged plan (every row's logits), then one
        decode step per sequence over its cached prompt with the reference's greedy token:
        each within the tolerance of transformers on the prompt and on the prompt plus that
        token."""
        self.check_v1_logits(backend, golden_checkpoints, preset, page_size, "cpu")

    @pytest.mark.spec("GLD-017", "GLD-046")
    @pytest.mark.parametrize("preset", CUDA_PRESETS)
    def test_cuda_v0_and_v1_logits(
        self, backend: Backend, golden_checkpoints: GoldenCheckpoints, preset: str
    ) -> None:
        """On a machine with CUDA, for every preset and every family preset: the v0 plan's
        and the v1 prefill's and first decode step's logits (pages of 1, 5 and 16) on the GPU
        within the float32 tolerance of transformers on the GPU; the same checks as the two
        tests above, which run them on the CPU. Skipped without CUDA, or for a backend that
        does not declare ``cuda``."""
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device: torch.cuda.is_available() is false")
        if "cuda" not in backend.capabilities:
            pytest.skip(f"backend {backend.name!r} does not declare 'cuda'")
        self.check_v0_logits(backend, golden_checkpoints, preset, "cuda")
        for page_size in (1, 5, 16):
            self.check_v1_logits(backend, golden_checkpoints, preset, page_size, "cuda")

    def check_v0_logits(
        self, backend: Backend, checkpoints: GoldenCheckpoints, preset: str, device: str
    ) -> None:
        """The ragged batch in one cache-less plan on ``device``: every position's logits
        within the float32 tolerance of transformers on the same device."""
        batch = prompts(preset_spec(preset).vocab)
        reference = checkpoints.reference(preset, "float32", device)
        runner = self.runner(backend, checkpoints, preset, None, 4, device=device)
        plan = build_recompute_plan([SeqChunk(tuple(p), 0, (), True) for p in batch], device)
        logits = runner.execute(plan)
        assert logits.shape[0] == plan.num_tokens, "not every row's logits"
        got = split_rows(logits.float().cpu(), [len(p) for p in batch])
        for prompt, rows in zip(batch, got, strict=True):
            want = reference_logits(reference, prompt).cpu()
            assert float((rows - want).abs().max()) <= FP32_ATOL

    def check_v1_logits(
        self,
        backend: Backend,
        checkpoints: GoldenCheckpoints,
        preset: str,
        page_size: int,
        device: str,
    ) -> None:
        """The ragged batch prefilled in one paged plan on ``device``, then one decode step per
        sequence: every row within the float32 tolerance of transformers on that device."""
        batch = prompts(preset_spec(preset).vocab)
        reference = checkpoints.reference(preset, "float32", device)
        lengths = [len(p) for p in batch]
        tables = page_tables([n + 1 for n in lengths], page_size)
        num_pages = sum(len(t) for t in tables)
        runner = self.runner(backend, checkpoints, preset, num_pages, page_size, device=device)
        prefill = build_paged_plan(
            [SeqChunk(tuple(p), 0, t, True) for p, t in zip(batch, tables, strict=True)],
            page_size,
            device,
        )
        logits = runner.execute(prefill)
        assert logits.shape[0] == prefill.num_tokens, "not every row's logits"
        got = split_rows(logits.float().cpu(), lengths)
        nexts = []
        for prompt, rows in zip(batch, got, strict=True):
            want = reference_logits(reference, prompt).cpu()
            assert float((rows - want).abs().max()) <= FP32_ATOL, "prefill logits"
            nexts.append(int(want[-1].argmax()))
        decode = build_paged_plan(
            [
                SeqChunk((token,), len(prompt), table)
                for prompt, token, table in zip(batch, nexts, tables, strict=True)
            ],
            page_size,
            device,
        )
        stepped = runner.execute(decode).float().cpu()
        for b, (prompt, token) in enumerate(zip(batch, nexts, strict=True)):
            want = reference_logits(reference, [*prompt, token])[-1].cpu()
            assert float((stepped[b] - want).abs().max()) <= FP32_ATOL, f"decode of {b}"

    @pytest.mark.spec("GLD-013", "GLD-041")
    @pytest.mark.parametrize("preset", MODELS)
    def test_chunks_starting_mid_page_beside_decodes(
        self, backend: Backend, golden_checkpoints: GoldenCheckpoints, preset: str
    ) -> None:
        """Pages of 5: a 32-token prompt computed in chunks of 11, 11 and 10 (the second and
        third start mid-page), sharing each step with a 7-token prompt's prefill and then its
        decode tokens: every row of the chunks and every decode row within the tolerance."""
        long, short = prompts(preset_spec(preset).vocab)[2], prompts(preset_spec(preset).vocab)[3]
        reference = golden_checkpoints.reference(preset, "float32", "cpu")
        want_long = reference_logits(reference, long)
        long_pages, short_pages = page_tables([len(long), len(short) + 2], 5)
        runner = self.runner(
            backend, golden_checkpoints, preset, len(long_pages) + len(short_pages), 5
        )
        context = list(short)
        for step, (start, stop) in enumerate([(0, 11), (11, 22), (22, 32)]):
            chunk = SeqChunk(tuple(long[start:stop]), start, long_pages, True)
            if step == 0:
                other = SeqChunk(tuple(short), 0, short_pages, True)
            else:
                other = SeqChunk((context[-1],), len(context) - 1, short_pages)
            logits = runner.execute(build_paged_plan([chunk, other], 5, "cpu")).float().cpu()
            rows = stop - start
            got = float((logits[:rows] - want_long[start:stop]).abs().max())
            assert got <= FP32_ATOL, f"chunk {start}..{stop}: {got}"
            want_short = reference_logits(reference, context)
            tail = want_short if step == 0 else want_short[-1:]
            assert float((logits[rows:] - tail).abs().max()) <= FP32_ATOL, f"decode at {step}"
            context.append(int(want_short[-1].argmax()))

    @pytest.mark.spec("GLD-032")
    @pytest.mark.parametrize("preset", SCALED)
    def test_scaled_rope_logits_past_the_original_context(
        self, backend: Backend, golden_checkpoints: GoldenCheckpoints, preset: str
    ) -> None:
        """Each scaled-RoPE preset (YaRN, linear, Llama 3, proportional) on prompts of up to 60
        tokens, past its original context: a v0 plan's and a v1 prefill's (pages of 5) logits
        at every position, and the first decode step's, within the float32 tolerance."""
        batch = prompts(preset_spec(preset).vocab, SCALED_LENGTHS)
        reference = golden_checkpoints.reference(preset, "float32", "cpu")
        lengths = [len(p) for p in batch]
        wants = [reference_logits(reference, p) for p in batch]
        v0 = self.runner(backend, golden_checkpoints, preset, None, 4)
        plan = build_recompute_plan([SeqChunk(tuple(p), 0, (), True) for p in batch], "cpu")
        for rows, want in zip(
            split_rows(v0.execute(plan).float().cpu(), lengths), wants, strict=True
        ):
            assert rows.shape == want.shape, "not every row's logits"
            assert float((rows - want).abs().max()) <= FP32_ATOL, "v0 logits"
        tables = page_tables([n + 1 for n in lengths], 5)
        v1 = self.runner(backend, golden_checkpoints, preset, sum(len(t) for t in tables), 5)
        chunks = [SeqChunk(tuple(p), 0, t, True) for p, t in zip(batch, tables, strict=True)]
        prefill = v1.execute(build_paged_plan(chunks, 5, "cpu")).float().cpu()
        for rows, want in zip(split_rows(prefill, lengths), wants, strict=True):
            assert rows.shape == want.shape, "not every row's logits"
            assert float((rows - want).abs().max()) <= FP32_ATOL, "v1 prefill logits"
        nexts = [int(want[-1].argmax()) for want in wants]
        decode = [
            SeqChunk((token,), len(p), t) for p, token, t in zip(batch, nexts, tables, strict=True)
        ]
        stepped = v1.execute(build_paged_plan(decode, 5, "cpu")).float().cpu()
        for b, (p, token) in enumerate(zip(batch, nexts, strict=True)):
            want = reference_logits(reference, [*p, token])[-1]
            assert float((stepped[b] - want).abs().max()) <= FP32_ATOL, f"decode of {b}"

    @pytest.mark.spec("GLD-016")
    @pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
    def test_16_bit_checkpoints_run_to_float32_logits(
        self, backend: Backend, golden_checkpoints: GoldenCheckpoints, dtype: str
    ) -> None:
        """The dense checkpoint stored in 16 bits, run in that dtype: a v0 plan's and a v1
        prefill's (pages of 5) logits at every position are finite float32, within the 16-bit
        tolerance of transformers in the same dtype and of the float32 reference."""
        preset = MODELS[0]
        batch = prompts(preset_spec(preset).vocab)
        lengths = [len(p) for p in batch]
        same = golden_checkpoints.reference(preset, dtype, "cpu")
        full = golden_checkpoints.reference(preset, "float32", "cpu")
        v0 = self.runner(backend, golden_checkpoints, preset, None, 4, dtype)
        plan = build_recompute_plan([SeqChunk(tuple(p), 0, (), True) for p in batch], "cpu")
        tables = page_tables(lengths, 5)
        v1 = self.runner(backend, golden_checkpoints, preset, sum(len(t) for t in tables), 5, dtype)
        chunks = [SeqChunk(tuple(p), 0, t, True) for p, t in zip(batch, tables, strict=True)]
        for logits in (v0.execute(plan), v1.execute(build_paged_plan(chunks, 5, "cpu"))):
            assert logits.dtype == torch.float32, f"logits in {logits.dtype}"
            assert bool(torch.isfinite(logits).all()), "non-finite logits"
            for prompt, rows in zip(batch, split_rows(logits.cpu(), lengths), strict=True):
                assert rows.shape[0] == len(prompt), "not every row's logits"
                assert (
                    float((rows - reference_logits(same, prompt)).abs().max()) <= HALF_ATOL[dtype]
                )
                assert (
                    float((rows - reference_logits(full, prompt)).abs().max())
                    <= (HALF_VS_FP32_ATOL[dtype])
                )
