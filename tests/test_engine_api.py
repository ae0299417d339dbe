"""The offline API on the embedded default model: text prompts, chat template, stop strings,
batch generation with a progress bar (specs/engine.md ENG-010, ENG-014, ENG-043, ENG-060)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pagedkv import LLM, SamplingParams
from pagedkv.assets import default_model_dir
from pagedkv.engine.outputs import FinishReason

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(default_model_dir(), num_pages=128, page_size=16)


@pytest.mark.spec("ENG-010")
def test_text_prompts_are_tokenized(llm: LLM) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    text = "import os\nimport sys\n\ndef main("
    (out,) = llm.generate(text, GREEDY, use_tqdm=False)
    assert list(out.prompt_token_ids) == tokenizer.encode(text, add_special_tokens=False)
    assert out.text == tokenizer.decode(list(out.token_ids), skip_special_tokens=True)
    assert out.text.strip(), "the default model should produce text"


@pytest.mark.spec("ENG-014")
def test_generate_keeps_prompt_order(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = ["class ", "def __init__(self", "return", "    for i in range("]
    outs = llm.generate(prompts, GREEDY, use_tqdm=True)
    assert [o.prompt_token_ids for o in outs] == [
        llm.engine.tokenizer.encode(p)
        for p in prompts  # type: ignore[union-attr]
    ]
    assert all(o.finished for o in outs)
    assert "generating" in capsys.readouterr().err  # the progress bar
    singles = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts]
    assert [o.token_ids for o in outs] == [o.token_ids for o in singles]
    assert capsys.readouterr().err == ""  # use_tqdm=False prints nothing


@pytest.mark.spec("ENG-043")
def test_stop_strings_are_trimmed(llm: LLM) -> None:
    prompt = "def read_file(path):\n"
    (free,) = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0.0), use_tqdm=False)
    text = free.text
    assert len(text) > 12
    stop = text[8:11]
    cut = text.index(stop)
    params = SamplingParams(max_tokens=40, temperature=0.0, stop=(stop, "\x00never"))
    (stopped,) = llm.generate(prompt, params, use_tqdm=False)
    assert stopped.text == text[:cut]
    assert stopped.finish_reason is FinishReason.STOP
    assert len(stopped.token_ids) < len(free.token_ids)


@pytest.mark.spec("ENG-060")
def test_chat_uses_the_template(llm: LLM) -> None:
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Open a file."},
    ]
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    (out,) = llm.chat(messages, GREEDY, use_tqdm=False)
    assert list(out.prompt_token_ids) == tokenizer.encode(text, add_special_tokens=False)
    assert "<|im_start|>assistant" in tokenizer.decode(list(out.prompt_token_ids))
    assert len(out.token_ids) > 0


@pytest.mark.spec("ENG-034")
def test_max_model_len_is_capped_by_the_model() -> None:
    from pagedkv import EngineConfig
    from pagedkv.backend import load_engine
    from pagedkv.errors import RequestTooLong

    engine = load_engine(default_model_dir(), EngineConfig(num_pages=128, max_model_len=4096))
    assert engine.max_model_len == 1024  # the default model's max_position_embeddings
    with pytest.raises(RequestTooLong):
        engine.add_request([5] * 1000, SamplingParams(max_tokens=25))
    assert not engine.has_unfinished_requests()
