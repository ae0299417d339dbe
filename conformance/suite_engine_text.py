"""Text through the engine: tokenized prompts, ``text`` and ``new_text``, stop strings.

The engine gets a real tokenizer (the embedded default model's) over the hash stand-in with the
tokenizer's vocabulary: its tokens decode to real, if meaningless, text, and solo greedy runs
still say exactly which tokens each request must produce.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pagedkv.assets import default_model_dir
from pagedkv.engine.outputs import FinishReason, RequestOutput
from pagedkv.engine.params import OutputKind, SamplingParams
from pagedkv.engine.tokenizer import Tokenizer
from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import Backend
from pagedkv.testing.faults import IdTokenizer

from .engine_harness import EngineUnderTest, build_engine, solo_greedy

PROMPTS = ("def read_config(path):\n", "The page table maps", "import os\nimport sys\n")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(default_model_dir())


def text_engine(backend: Backend, tokenizer: Tokenizer) -> EngineUnderTest:
    """An engine with the tokenizer over a hash runner of the default model's vocabulary."""
    config = json.loads((default_model_dir() / "config.json").read_text(encoding="utf-8"))
    vocab = int(config["vocab_size"])
    return build_engine(backend, tokenizer=tokenizer, vocab=vocab, num_pages=128)


def stream_of(eut: EngineUnderTest, prompt: str, params: SamplingParams) -> list[RequestOutput]:
    return list(eut.engine.stream(prompt, params))


def clean_window(text: str, start: int, boundaries: set[int], width: int = 3) -> str:
    """The first ``width`` characters at or after ``start`` that are printable, hold no
    replacement character, are first found there (so a stop string cuts at a known place) and
    straddle one of ``boundaries`` (the text's length after some token), so the stop string
    completes a step after it began: an engine that releases text it should hold back fails."""
    for i in range(start, len(text) - width):
        window = text[i : i + width]
        if (
            window.isprintable()
            and "\ufffd" not in window
            and text.index(window) == i
            and any(i < b < i + width for b in boundaries)
        ):
            return window
    raise AssertionError(f"no clean {width}-character window in {text!r}")


@pytest.mark.requires("engine")
class EngineTextSuite:
    """ENG-010, ENG-013 and ENG-043 with a tokenizer."""

    @pytest.mark.spec("ENG-010", "ENG-013")
    def test_text_prompts_and_text_outputs(self, backend: Backend, tokenizer: Tokenizer) -> None:
        """A text prompt is tokenized; each output's text is the decoded tokens so far, and the
        ``new_text`` of a step() loop adds up to it."""
        eut = text_engine(backend, tokenizer)
        vocab = eut.runner.vocab_size
        ids = {
            eut.engine.add_request(p, SamplingParams(max_tokens=20, temperature=0.0)): p
            for p in PROMPTS
        }
        pieces = dict.fromkeys(ids, "")
        final: dict[str, RequestOutput] = {}
        while eut.engine.has_unfinished_requests():
            for output in eut.engine.step():
                pieces[output.request_id] += output.new_text
                assert output.text.startswith(pieces[output.request_id])
                if output.finished:
                    final[output.request_id] = output
        for rid, prompt in ids.items():
            out = final[rid]
            assert list(out.prompt_token_ids) == tokenizer.encode(prompt)
            assert list(out.token_ids) == solo_greedy(out.prompt_token_ids, 20, vocab)
            assert out.text == tokenizer.decode(out.token_ids)
            assert pieces[rid] == out.text, "new_text does not add up to the text"

    @pytest.mark.spec("ENG-013")
    def test_a_stream_adds_up_to_the_text(self, backend: Backend, tokenizer: Tokenizer) -> None:
        eut = text_engine(backend, tokenizer)
        outputs = stream_of(eut, PROMPTS[1], SamplingParams(max_tokens=24, temperature=0.0))
        assert outputs[-1].finished
        assert "".join(o.new_text for o in outputs) == outputs[-1].text
        assert outputs[-1].text == tokenizer.decode(outputs[-1].token_ids)

    @pytest.mark.spec("ENG-157")
    def test_final_only_returns_the_finished_output_alone(
        self, backend: Backend, tokenizer: Tokenizer
    ) -> None:
        """A ``final_only`` request gets one output from ``step()``, once it has finished: the
        tokens and text of the same request run ``every_step``, its deltas the whole of them;
        an ``every_step`` request beside it still gets an output from every step."""
        params = SamplingParams(max_tokens=12, temperature=0.0)
        eut = text_engine(backend, tokenizer)
        final_only = replace(params, output_kind=OutputKind.FINAL_ONLY)
        waiting = eut.engine.add_request(PROMPTS[0], final_only)
        beside = eut.engine.add_request(PROMPTS[1], params)
        seen: dict[str, list[RequestOutput]] = {waiting: [], beside: []}
        while eut.engine.has_unfinished_requests():
            for output in eut.engine.step():
                seen[output.request_id].append(output)
        assert len(seen[waiting]) == 1, "a final_only request got outputs before its end"
        assert len(seen[beside]) == 12
        final = seen[waiting][0]
        (alone,) = stream_of(text_engine(backend, tokenizer), PROMPTS[0], params)[-1:]
        assert final.finished
        assert final.token_ids == alone.token_ids
        assert final.text == alone.text != ""
        assert final.new_text == final.text
        assert final.outputs[0].new_token_ids == final.token_ids

    @pytest.mark.spec("ENG-043")
    def test_stop_strings_end_generation_and_are_trimmed(
        self, backend: Backend, tokenizer: Tokenizer
    ) -> None:
        """A stop string taken from the free-running text ends generation early; the text
        (and the stream of new_text) ends right before it; the earliest of several wins."""
        free_params = SamplingParams(max_tokens=40, temperature=0.0)
        (free,) = stream_of(text_engine(backend, tokenizer), PROMPTS[0], free_params)[-1:]
        text = free.text
        assert len(text) > 30, text
        boundaries = {len(tokenizer.decode(free.token_ids[:k])) for k in range(40)}
        stop = clean_window(text, 10, boundaries)
        later = clean_window(text, text.index(stop) + 8, boundaries)
        cut = text.index(stop)
        params = SamplingParams(max_tokens=40, temperature=0.0, stop=(later, stop, "\x00never"))
        outputs = stream_of(text_engine(backend, tokenizer), PROMPTS[0], params)
        released = ""
        for output in outputs:
            released += output.new_text
            assert text[:cut].startswith(released), f"released {released!r} past the cut"
        last = outputs[-1]
        assert last.finish_reason is FinishReason.STOP
        assert last.text == text[:cut]
        assert "".join(o.new_text for o in outputs) == text[:cut], "the stream leaked the stop"
        assert len(last.token_ids) < len(free.token_ids)
        assert list(last.token_ids) == list(free.token_ids[: len(last.token_ids)])

    @pytest.mark.spec("ENG-010")
    def test_stop_strings_need_a_tokenizer(self, backend: Backend) -> None:
        eut = build_engine(backend)
        with pytest.raises(InvalidRequest):
            eut.engine.add_request([1, 2, 3], SamplingParams(stop=("x",)))
        assert not eut.engine.has_unfinished_requests()

    @pytest.mark.spec("ENG-043")
    def test_a_stop_string_at_the_very_start(self, backend: Backend, tokenizer: Tokenizer) -> None:
        """A stop string found at the first character leaves no text at all."""
        free_params = SamplingParams(max_tokens=12, temperature=0.0)
        for prompt in PROMPTS:
            (free,) = stream_of(text_engine(backend, tokenizer), prompt, free_params)[-1:]
            start = free.text[:3]
            if len(start) == 3 and start.isprintable() and "\ufffd" not in start:
                break
        else:
            raise AssertionError("no prompt's text starts with three clean characters")
        params = SamplingParams(max_tokens=12, temperature=0.0, stop=(start,))
        outputs = stream_of(text_engine(backend, tokenizer), prompt, params)
        assert outputs[-1].finish_reason is FinishReason.STOP
        assert outputs[-1].text == ""
        assert "".join(o.new_text for o in outputs) == ""

    @pytest.mark.spec("ENG-090", "ENG-042")
    @pytest.mark.parametrize("by", ["eos", "stop token"])
    def test_the_text_of_a_stopping_token_is_left_out(self, backend: Backend, by: str) -> None:
        """The third token ends the request, as EOS or as a stop token: the text (and the
        streamed deltas) hold the first two tokens' text only, with ``IdTokenizer``'s
        spelling of ids."""
        prompt = [10, 20, 30]
        expected = solo_greedy(prompt, 6)
        stop = expected[2]
        assert stop not in expected[:2], "pick a prompt whose third token is new"
        eos = frozenset({stop}) if by == "eos" else frozenset()
        eut = build_engine(backend, tokenizer=IdTokenizer(), eos_ids=eos)
        params = SamplingParams(
            max_tokens=6, temperature=0.0, stop_token_ids=() if by == "eos" else (stop,)
        )
        outputs = list(eut.engine.stream(prompt, params))
        final = outputs[-1]
        assert list(final.token_ids) == expected[:3]
        assert final.finish_reason is FinishReason.STOP
        assert final.text == IdTokenizer().decode(expected[:2])
        assert "".join(o.new_text for o in outputs) == final.text

    @pytest.mark.spec("ENG-091", "ENG-090")
    def test_text_held_back_at_the_end_is_released(self, backend: Backend) -> None:
        """The last token's text begins a stop string, so it is held back, until the request
        ends by length: then it is released, and the text is every token's."""
        prompt = [10, 20, 30]
        expected = solo_greedy(prompt, 3)
        eut = build_engine(backend, tokenizer=IdTokenizer())
        params = SamplingParams(max_tokens=3, temperature=0.0, stop=(f"{expected[2]} x",))
        outputs = list(eut.engine.stream(prompt, params))
        final = outputs[-1]
        assert final.finish_reason is FinishReason.LENGTH
        assert final.text == IdTokenizer().decode(expected)
        assert "".join(o.new_text for o in outputs) == final.text
