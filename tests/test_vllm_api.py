"""The Python API in vLLM's shapes (specs/engine.md ENG-061, ENG-062), on the embedded model.

The first test is a vLLM user's script, unchanged but for its import line.
"""

from __future__ import annotations

import multiprocessing
import re
from typing import Any

import pytest

from pagedkv import LLM, CompletionOutput, RequestOutput, SamplingParams
from pagedkv.assets import has_default_model
from pagedkv.engine.chat_template import InvalidTemplateKwargs
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm import run_to_completion
from pagedkv.errors import InvalidRequest

pytestmark = pytest.mark.skipif(not has_default_model(), reason="the embedded model is absent")

VLLM_SCRIPT = """
from pagedkv import LLM, SamplingParams

prompts = ["Hello, my name is", "def fibonacci(n):"]
sampling_params = SamplingParams(n=2, temperature=0.8, top_p=0.95, seed=0, max_tokens=8)
llm = LLM(block_size=8, num_pages=128)
outputs = llm.generate(prompts, sampling_params=sampling_params)
seen = []
for output in outputs:
    prompt = output.prompt
    for i in range(len(output.outputs)):
        generated_text = output.outputs[i].text
        seen.append((prompt, output.outputs[i].index, generated_text))
tokenizer = llm.get_tokenizer()
"""

GREEDY = SamplingParams(max_tokens=6, temperature=0)


@pytest.fixture(scope="module")
def script() -> dict[str, Any]:
    """What the vLLM script leaves behind."""
    namespace: dict[str, Any] = {}
    exec(compile(VLLM_SCRIPT, "vllm_script.py", "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def llm(script: dict[str, Any]) -> LLM:
    value = script["llm"]
    assert isinstance(value, LLM)
    return value


@pytest.mark.spec("ENG-061")
def test_a_vllm_script_runs_unchanged(script: dict[str, Any], llm: LLM) -> None:
    outputs: list[RequestOutput] = script["outputs"]
    assert [(p, i) for p, i, _ in script["seen"]] == [
        ("Hello, my name is", 0),
        ("Hello, my name is", 1),
        ("def fibonacci(n):", 0),
        ("def fibonacci(n):", 1),
    ]
    assert llm.engine.config.page_size == 8  # block_size is page_size
    tokenizer = script["tokenizer"]
    for output in outputs:
        assert output.prompt_token_ids == tokenizer.encode(output.prompt)
        assert isinstance(output.num_cached_tokens, int)
        assert output.finished
        for completion in output.outputs:
            assert isinstance(completion, CompletionOutput)
            assert len(completion.token_ids) == 8
            assert completion.text == tokenizer.decode(completion.token_ids)
            assert completion.finish_reason == "length"
            assert completion.stop_reason is None
            assert completion.cumulative_logprob is not None
            assert completion.cumulative_logprob < 0
            assert completion.finished()
    assert outputs[0].outputs[0].token_ids != outputs[0].outputs[1].token_ids


@pytest.mark.spec("ENG-061")
def test_earlier_names_still_work(llm: LLM) -> None:
    (by_keyword,) = llm.generate("import os", params=GREEDY, use_tqdm=False)
    (positional,) = llm.generate("import os", GREEDY, use_tqdm=False)
    assert by_keyword.text == positional.outputs[0].text
    assert by_keyword.token_ids == positional.outputs[0].token_ids
    assert by_keyword.finish_reason == positional.outputs[0].finish_reason
    with pytest.raises(InvalidRequest):
        llm.generate("import os", sampling_params=GREEDY, params=GREEDY)
    with pytest.raises(InvalidRequest, match="block_size"):
        LLM(page_size=16, block_size=8)


@pytest.mark.spec("ENG-062")
def test_prompt_dicts(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("class Config:")
    outs = llm.generate(
        [{"prompt_token_ids": ids}, {"prompt": "class Config:"}, "class Config:", ids],
        GREEDY,
        use_tqdm=False,
    )
    assert [o.prompt_token_ids for o in outs] == [list(ids)] * 4
    assert [o.prompt for o in outs] == [None, "class Config:", "class Config:", None]
    assert len({tuple(o.token_ids) for o in outs}) == 1
    (single,) = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert single.token_ids == outs[0].token_ids


@pytest.mark.spec("ENG-062")
@pytest.mark.parametrize("form", ["prompt", "prompt_token_ids"])
def test_a_prompt_dict_carries_its_cache_salt(llm: LLM, form: str) -> None:
    text = ("import json\n" if form == "prompt" else "import yaml\n") * 12  # no page shared
    prompt = text if form == "prompt" else llm.get_tokenizer().encode(text)
    llm.generate({form: prompt, "cache_salt": "a"}, GREEDY, use_tqdm=False)  # type: ignore[misc]
    (same,) = llm.generate({form: prompt, "cache_salt": "a"}, GREEDY, use_tqdm=False)  # type: ignore[misc]
    (other,) = llm.generate({form: prompt, "cache_salt": "b"}, GREEDY, use_tqdm=False)  # type: ignore[misc]
    (unsalted,) = llm.generate({form: prompt}, GREEDY, use_tqdm=False)  # type: ignore[misc]
    assert same.num_cached_tokens > 0
    assert other.num_cached_tokens == 0
    assert unsalted.num_cached_tokens == 0


@pytest.mark.spec("ENG-062")
@pytest.mark.parametrize(
    ("prompt", "named"),
    [
        ({"prompt_token_ids": [1, 2], "multi_modal_data": {}}, "multi_modal_data"),
        ({"prompt": "x", "prompt_token_ids": [1]}, "exactly one"),
        ({"cache_salt": "a"}, "exactly one"),
        ({"prompt_token_ids": ["a"]}, "integer"),
        ({"prompt": 3}, "text"),
    ],
)
def test_bad_prompt_dicts_are_refused_by_name(llm: LLM, prompt: Any, named: str) -> None:
    with pytest.raises(InvalidRequest, match=named):
        llm.generate(prompt, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.spec("ENG-151", "ENG-152")
@pytest.mark.parametrize(
    "ids",
    [{1, 2}, 7, "abc", b"ab", {"a": 1}, [1, True], [1, 2.0]],
    ids=["set", "int", "text", "bytes", "dict", "bool", "float"],
)
def test_token_ids_that_are_not_a_sequence_of_ints_are_refused(llm: LLM, ids: Any) -> None:
    with pytest.raises(InvalidRequest, match="prompt_token_ids must"):
        llm.generate(
            [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False
        )
    assert not llm.engine.has_unfinished_requests()
    ok = {"prompt_token_ids": (1, 2)}
    assert llm.generate(ok, GREEDY, use_tqdm=False)[0].prompt_token_ids == [
        1,
        2,
    ]  # a tuple given, a list returned (vLLM)


@pytest.mark.spec("ENG-153")
def test_any_iterable_of_prompts_is_a_batch(llm: LLM) -> None:
    prompts = ["import os", "import sys"]
    outs = llm.generate((p for p in prompts), GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [o.prompt for o in llm.generate(tuple(prompts), GREEDY, use_tqdm=False)] == prompts


@pytest.mark.spec("ENG-061")
def test_get_tokenizer_is_the_hugging_face_tokenizer(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    (chat,) = llm.chat(messages, GREEDY, use_tqdm=False)
    assert chat.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.spec("ENG-047", "PST-006")
def test_samples_on_the_real_model_equal_their_solo_runs(llm: LLM) -> None:
    """On the real model and its PagedStore, each of ``n=3`` samples (the prompt's partial
    page copied for two of them) equals the prompt run alone with seed ``seed + i``."""
    prompt = "def read_config(path):\n    with open(path) as f:\n"
    assert len(llm.get_tokenizer().encode(prompt)) % 8 != 0  # a partial page to copy
    params = SamplingParams(n=3, temperature=0.9, seed=41, max_tokens=10)
    (out,) = llm.generate(prompt, params, use_tqdm=False)
    solo = llm.generate(
        [prompt] * 3,
        [SamplingParams(temperature=0.9, seed=41 + i, max_tokens=10) for i in range(3)],
        use_tqdm=False,
    )
    assert [c.token_ids for c in out.outputs] == [o.token_ids for o in solo]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def progress_line(stderr: str) -> str:
    """The last state a progress bar drew on ``stderr``."""
    return stderr.strip().split("\r")[-1].strip()


@pytest.mark.spec("ENG-154")
def test_a_progress_bar_counts_finished_prompts_when_asked(
    llm: LLM, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = ["import os", "import re"]
    llm.generate(prompts, GREEDY)  # use_tqdm by default, as vLLM
    bar = progress_line(capsys.readouterr().err)
    assert bar.startswith("generating: 100%"), bar
    assert " 2/2 [" in bar, bar
    assert re.search(r"(req/s|s/req)\]$", bar), bar  # the unit: requests
    llm.generate(prompts, GREEDY, use_tqdm=False)
    run_to_completion(llm.engine, prompts, GREEDY)  # off by default
    messages = [{"role": "user", "content": "hi"}]
    llm.chat(messages, GREEDY, use_tqdm=False)
    assert capsys.readouterr().err == ""
    llm.chat([messages, messages], GREEDY)  # use_tqdm by default
    assert " 2/2 [" in progress_line(capsys.readouterr().err)


@pytest.mark.spec("ENG-023")
def test_run_to_completion_salts_every_prompt(llm: LLM) -> None:
    prompt = "import csv\n" * 12
    run_to_completion(llm.engine, [prompt], GREEDY, cache_salt="csv")
    (same,) = run_to_completion(llm.engine, [prompt], GREEDY, cache_salt="csv")
    (unsalted,) = run_to_completion(llm.engine, [prompt], GREEDY)
    assert same.num_cached_tokens > 0
    assert unsalted.num_cached_tokens == 0


@pytest.mark.spec("ENG-155")
def test_chat_takes_one_conversation_or_a_list_of_them(llm: LLM) -> None:
    one = [{"role": "user", "content": "hi"}]
    other = [{"role": "user", "content": "bye"}]
    (single,) = llm.chat(one, GREEDY, use_tqdm=False)
    outs = llm.chat([one, other], GREEDY, use_tqdm=False)
    assert len(outs) == 2
    assert outs[0].prompt_token_ids == single.prompt_token_ids
    assert outs[1].prompt_token_ids != single.prompt_token_ids
    with pytest.raises(InvalidRequest, match="empty"):
        llm.chat([], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    (alone,) = llm.generate({"prompt_token_ids": single.prompt_token_ids}, GREEDY, use_tqdm=False)
    assert single.token_ids == alone.token_ids  # generated with the SamplingParams given
    (by_keyword,) = llm.chat(one, params=GREEDY, use_tqdm=False)
    assert by_keyword.token_ids == alone.token_ids
    assert llm.get_default_sampling_params().max_tokens != GREEDY.max_tokens
    with pytest.raises(InvalidTemplateKwargs, match="'enable_thinking'"):  # not read here
        llm.chat(one, GREEDY, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})


@pytest.mark.spec("ENG-156")
def test_engine_settings_reach_the_engine() -> None:
    before = set(multiprocessing.active_children())
    default = LLM()
    # every default is EngineConfig's, but the context: the model's own (ENG-183)
    assert default.engine.config == EngineConfig(max_model_len=1024)
    assert default.generate("x", GREEDY, use_tqdm=False)[0].finished
    assert set(multiprocessing.active_children()) == before  # one rank: no worker started
    given = {
        "num_pages": 40,
        "max_num_batched_tokens": 100,
        "max_num_seqs": 3,
        "max_model_len": 300,
        "enable_prefix_caching": False,
        "mode": "v0",
    }
    llm = LLM(page_size=4, **given)
    assert llm.engine.config == EngineConfig(page_size=4, **given)  # type: ignore[arg-type]
    assert LLM(page_size=8, block_size=8).engine.config.page_size == 8
    with pytest.raises(InvalidRequest, match="'tpu'"):  # the device reaches the engine's loader
        LLM(device="tpu", num_pages=16)
