"""``chat_template_kwargs`` checked against what the chat template reads (specs/serving.md
SRV-093, specs/engine.md ENG-150), on the template alone and through the tokenizer of a model
directory whose tokenizer has named chat templates. torch-free and fast: the tokenizer is the
embedded model's, copied with another template.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pagedkv.engine.chat_template import InvalidTemplateKwargs, check_template_kwargs
from pagedkv.engine.tokenizer import Tokenizer
from pagedkv.errors import InvalidRequest

#: Qwen3's switch: an empty, closed think block in the prompt when ``enable_thinking`` is false.
THINKING = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    '{{- "<think>\\n\\n</think>\\n\\n" }}{%- endif %}'
    "{%- if open_thinking is defined and open_thinking %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)
#: A template that reads only what the renderer sets itself.
PLAIN = "{%- for m in messages %}{{ m['content'] }}{%- endfor %}{{ eos_token }}"
#: A second, named template (tool use) reading a variable of its own.
TOOLS = "{{ tools | length }}{% if strict_tools %}!{% endif %}"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.spec("SRV-093")
def test_a_variable_the_template_reads_is_accepted() -> None:
    check_template_kwargs([THINKING], {"enable_thinking": False})
    check_template_kwargs([THINKING], {"enable_thinking": True, "open_thinking": True})
    check_template_kwargs([THINKING], {})


@pytest.mark.spec("SRV-093")
def test_a_variable_of_any_named_template_is_accepted() -> None:
    check_template_kwargs([THINKING, TOOLS], {"strict_tools": True, "enable_thinking": False})
    with pytest.raises(InvalidTemplateKwargs, match="'strict_tools'"):
        check_template_kwargs([THINKING], {"strict_tools": True})


@pytest.mark.spec("SRV-093")
@pytest.mark.parametrize("key", ["add_generation_prompt", "messages", "eos_token", "tools"])
def test_a_variable_the_renderer_sets_is_refused_even_when_the_template_reads_it(key: str) -> None:
    with pytest.raises(InvalidTemplateKwargs, match=f"'{key}' is set by the server itself"):
        check_template_kwargs([THINKING, PLAIN, TOOLS], {key: False})


@pytest.mark.spec("SRV-093", "ENG-150")
def test_an_unread_variable_is_refused_naming_what_the_template_reads() -> None:
    with pytest.raises(InvalidTemplateKwargs) as refused:
        check_template_kwargs([THINKING], {"enable_thinkin": False})
    assert str(refused.value) == (
        "chat_template_kwargs key 'enable_thinkin' is not read by this model's chat template "
        "(it reads: enable_thinking, open_thinking)"
    )
    with pytest.raises(InvalidTemplateKwargs) as refused:
        check_template_kwargs([PLAIN], {"enable_thinking": False})
    assert str(refused.value).endswith("(it reads: none)")


@pytest.mark.spec("SRV-093")
def test_the_first_offending_key_alphabetically_is_named() -> None:
    with pytest.raises(InvalidTemplateKwargs, match="'add_generation_prompt'"):
        check_template_kwargs(
            [THINKING], {"zzz": 1, "enable_thinking": False, "add_generation_prompt": True}
        )
    with pytest.raises(InvalidTemplateKwargs, match="'aaa'"):
        check_template_kwargs([THINKING], {"zzz": 1, "aaa": 1, "enable_thinking": False})


@pytest.fixture(scope="module", params=["named", "single"])
def tokenizer_dir(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> tuple[Path, bool]:
    """The embedded model's tokenizer with Qwen3's thinking switch in its chat template: the one
    template, or named templates ``default`` and ``tool_use`` (transformers loads them as a
    dict); whether they are named."""
    from pagedkv.assets import default_model_dir

    source, directory = default_model_dir(), tmp_path_factory.mktemp("templates")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).exists():
            shutil.copy(source / name, directory / name)
    config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = (
        [{"name": "default", "template": THINKING}, {"name": "tool_use", "template": TOOLS}]
        if request.param == "named"
        else THINKING
    )
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory, request.param == "named"


@pytest.mark.spec("SRV-093")
def test_the_tokenizer_passes_template_kwargs_to_the_template(
    tokenizer_dir: tuple[Path, bool],
) -> None:
    directory, named = tokenizer_dir
    tokenizer = Tokenizer(directory)
    assert isinstance(tokenizer.hf.chat_template, dict) == named
    plain = tokenizer.apply_chat_template(MESSAGES)
    closed = tokenizer.apply_chat_template(MESSAGES, {"enable_thinking": False})
    rendered = tokenizer.hf.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert closed == tokenizer.encode(rendered)
    assert tokenizer.decode(closed) == tokenizer.decode(plain) + "<think>\n\n</think>\n\n"
    if named:  # a variable only the tool-use template reads
        assert tokenizer.apply_chat_template(MESSAGES, {"strict_tools": True}) == plain
    with pytest.raises(InvalidTemplateKwargs, match="'enable_thinkin'"):
        tokenizer.apply_chat_template(MESSAGES, {"enable_thinkin": False})
    with pytest.raises(InvalidRequest, match="'add_generation_prompt'"):
        tokenizer.apply_chat_template(MESSAGES, {"add_generation_prompt": False})
