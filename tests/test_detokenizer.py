"""Incremental detokenization and stop strings (specs/engine.md ENG-090, ENG-091).

The property: for any output tokens, stop strings and split of the tokens into steps, the
released deltas add up to the final text, and the final text is the reference's: the full
decode, cut before the earliest stop string found once the step that completes it arrives. Both
decoders run on the embedded model's tokenizer. Then the reproduction of the issue on the engine,
its stream and ``pagedkv generate --stream``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv import LLM, SamplingParams
from pagedkv.assets import default_model_dir, has_default_model
from pagedkv.engine.detokenizer import IncrementalDetokenizer
from pagedkv.engine.tokenizer import Tokenizer

pytestmark = pytest.mark.skipif(not has_default_model(), reason="the embedded model is absent")

#: Characters prompts are drawn from: code-like ASCII and multi-byte characters, so tokens
#: split characters and stop strings span tokens.
ALPHABET = "ab path\n\n():de→é🙂"
#: The reproduction of the issue.
REPRO_PROMPT = "def read(path):"
REPRO_STOP = "path\n\ndef"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(default_model_dir())


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_pages=64)


def reference(
    tokenizer: Tokenizer, ids: Sequence[int], ends: Sequence[int], stops: Sequence[str]
) -> str:
    """The final text by definition: after each step (``ends``: token counts), decode
    everything so far; the first step whose text holds a stop string cuts the text before its
    earliest occurrence."""
    for end in ends:
        text = tokenizer.decode(ids[:end]).rstrip("\ufffd")
        found = [i for i in (text.find(s) for s in stops) if i >= 0]
        if found:
            return text[: min(found)]
    return tokenizer.decode(ids)


def run_steps(
    tokenizer: Tokenizer,
    ids: Sequence[int],
    ends: Sequence[int],
    stops: Sequence[str],
    window: bool = False,
) -> tuple[list[str], str]:
    """Feed ``ids`` step by step; the deltas released and the final text (``window``: with the
    sliding-window decoder instead of ``DecodeStream``)."""
    detokenizer = IncrementalDetokenizer(
        tokenizer.incremental_decoder(window=window), SamplingParams(stop=tuple(stops))
    )
    deltas, start = [], 0
    for number, end in enumerate(ends, start=1):
        stop = detokenizer.update(ids[start:end])
        start = end
        deltas.append(detokenizer.release(finished=stop is not None or number == len(ends)))
        if stop is not None:
            break
    return deltas, detokenizer.text


@st.composite
def cases(draw: st.DrawFn, tokenizer: Tokenizer) -> tuple[list[int], list[int], list[str]]:
    """Output tokens (of random text), step boundaries, and stop strings: pieces of the text
    (so they occur, often across tokens) or random strings."""
    text = draw(st.text(ALPHABET, min_size=1, max_size=40))
    ids = tokenizer.encode(text)
    cuts = draw(st.sets(st.integers(1, max(1, len(ids) - 1)), max_size=len(ids)))
    ends = sorted({*cuts, len(ids)})
    pieces = st.builds(
        lambda a, n: text[a : a + n], st.integers(0, len(text)), st.integers(1, 12)
    ).filter(bool)
    stops = draw(st.lists(st.one_of(pieces, st.text(ALPHABET, min_size=1, max_size=5)), max_size=3))
    return ids, ends, stops


@pytest.mark.spec("ENG-090", "ENG-091")
@pytest.mark.parametrize("window", [False, True], ids=["DecodeStream", "window"])
def test_deltas_add_up_to_the_final_text(tokenizer: Tokenizer, window: bool) -> None:
    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=cases(tokenizer))
    def check(case: tuple[list[int], list[int], list[str]]) -> None:
        ids, ends, stops = case
        deltas, final = run_steps(tokenizer, ids, ends, stops, window)
        assert "".join(deltas) == final
        assert final == reference(tokenizer, ids, ends, stops)
        assert "\ufffd" not in "".join(deltas[:-1])  # no half character is ever released

    check()


@pytest.mark.spec("ENG-091")
def test_only_a_possible_stop_string_is_held_back(tokenizer: Tokenizer) -> None:
    """Text ending with the start of a stop string waits; text that cannot become one is
    released at once."""
    detokenizer = IncrementalDetokenizer(
        tokenizer.incremental_decoder(), SamplingParams(stop=("path\n\ndef",))
    )
    ids = tokenizer.encode(" return path\n\nx")
    released = []
    for token in ids:
        detokenizer.update([token])
        released.append(detokenizer.release(finished=False))
    shown = "".join(released)
    assert shown == " return path\n\nx"
    assert released[-1].endswith("path\n\nx"), released  # held until "x" decided


@pytest.mark.spec("ENG-090")
def test_stop_tokens_min_tokens_and_included_stop_strings(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("one two three")
    keep = IncrementalDetokenizer(
        tokenizer.incremental_decoder(),
        SamplingParams(stop=("two",), include_stop_str_in_output=True),
    )
    assert keep.update(ids) == "two"
    assert keep.text == "one two"
    late = IncrementalDetokenizer(
        tokenizer.incremental_decoder(), SamplingParams(stop=("one",), min_tokens=len(ids))
    )
    assert late.update(ids) is None  # "one" lies within the first min_tokens tokens
    dropped = IncrementalDetokenizer(tokenizer.incremental_decoder(), SamplingParams())
    dropped.update(ids, stop_token=True)
    assert dropped.text == tokenizer.decode(ids[:-1])


@pytest.mark.spec("ENG-090", "ENG-043")
def test_reproduction_stream_equals_final(llm: LLM) -> None:
    """Stop ``path\\n\\ndef``, prompt ``def read(path):``, greedy: the streamed deltas and
    the final text are both ``" return "``, and the stop string is the stop reason."""
    params = SamplingParams(max_tokens=24, temperature=0, stop=[REPRO_STOP])
    (free,) = llm.generate(
        REPRO_PROMPT, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False
    )
    assert free.text.startswith(" return path\n\ndef"), free.text  # the stop string spans tokens
    (out,) = llm.generate(REPRO_PROMPT, params, use_tqdm=False)
    assert out.text == " return "
    assert out.outputs[0].stop_reason == REPRO_STOP
    deltas = [o.new_text for o in llm.engine.stream(REPRO_PROMPT, params)]
    assert "".join(deltas) == " return "


@pytest.mark.spec("ENG-090", "SRV-042")
def test_reproduction_in_generate_stream() -> None:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    args = [
        "generate",
        "--stream",
        "--max-tokens",
        "24",
        "--stop",
        REPRO_STOP,
        "--prompt",
        REPRO_PROMPT,
    ]
    result = subprocess.run(
        [sys.executable, "-m", "pagedkv", *args],
        capture_output=True,
        text=True,
        encoding="utf-8",
        env=env,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == " return \n"
