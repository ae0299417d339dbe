"""Measure the float32 logit differences and MoE routing margins of the family presets.

Prints the rows of the "Logits and routing" table of ``specs/golden.md`` (GLD-032, GLD-041,
GLD-043): for each preset of ``FAMILY_PRESETS``, the max abs logit difference against
transformers at every position of a v0 plan, of v1 prefills with pages of 1, 5 and 16, and of
the first decode step, the largest logit, and for MoE presets the max router-logit difference
and the smallest top-k router margin over the logit prompts and the golden greedy paths.
Uses the test modules' helpers, so it measures exactly what the tests check::

    .venv/bin/python scripts/measure_family_golden.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_model_family_golden import prompts_for, router_logits  # noqa: E402
from test_model_golden_logits import (  # noqa: E402
    PagedRun,
    every_row,
    make_case,
    max_diff,
    per_position_reference,
    run,
    v0_plan,
)

from pagedkv.testing.tiny_qwen3 import (  # noqa: E402
    FAMILY_PRESETS,
    build_tiny_checkpoint,
    min_router_margin,
    one_torch_thread,
    reference_logits,
)
from pagedkv_conformance.golden_harness import (  # noqa: E402
    NEW_TOKENS,
    golden_prompts,
    hf_greedy,
)


def measure(name: str, root: Path) -> str:
    """One table row for preset ``name``."""
    spec = FAMILY_PRESETS[name]
    case = make_case(name, build_tiny_checkpoint(spec, root / name), "cpu")
    prompts = prompts_for(spec.vocab)
    expected = per_position_reference(case, prompts)
    v0 = max_diff(run(case.ours, every_row(v0_plan(prompts, "cpu")), None), expected)
    next_tokens = [int(reference_logits(case.reference, p)[-1].argmax()) for p in prompts]
    extended = [[*p, t] for p, t in zip(prompts, next_tokens, strict=True)]
    decode_expected = torch.stack([reference_logits(case.reference, e)[-1] for e in extended])
    v1 = decode = 0.0
    for page_size in (1, 5, 16):
        paged = PagedRun(case.ours, page_size, "cpu")
        v1 = max(v1, max_diff(paged.step(list(enumerate(prompts)), all_rows=True), expected))
        step = paged.step([(s, [t]) for s, t in enumerate(next_tokens)])
        decode = max(decode, max_diff(step, decode_expected))
    row = f"| `{name}` | {v0:.2e} | {v1:.2e} | {decode:.2e} | {float(expected.abs().max()):.1f} |"
    if not spec.is_moe:
        return row + "  |  |"
    logit_prompts = prompts + prompts_for(spec.vocab, seed=1)
    router = 0.0
    for prompt in logit_prompts:
        with torch.no_grad():
            out = case.reference(input_ids=torch.tensor([prompt]), output_router_logits=True)
        ours = router_logits(case, prompt)
        for a, b in zip(ours, out.router_logits, strict=True):
            router = max(router, max_diff(a, b.reshape(a.shape).float()))
    golden = golden_prompts(spec.vocab)
    generated = hf_greedy(case.reference, golden, NEW_TOKENS)
    paths = [p + g for p, g in zip(golden, generated, strict=True)]
    margin = min_router_margin(case.reference, logit_prompts + paths)
    return row + f" {router:.1e} | {margin:.4f} |"


def main() -> None:
    with one_torch_thread(), tempfile.TemporaryDirectory() as tmp:
        for name in sorted(FAMILY_PRESETS):
            print(measure(name, Path(tmp)), flush=True)


if __name__ == "__main__":
    main()
