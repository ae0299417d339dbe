"""What the engine reads from a model directory besides the weights: EOS ids and the tokenizer
(specs/engine.md ENG-042, ENG-060)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv.engine.config import CacheMode
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.tokenizer import Tokenizer, eos_token_ids
from pagedkv.errors import CheckpointError


def write(path: Path, name: str, eos: object) -> None:
    (path / name).write_text(json.dumps({"eos_token_id": eos}), encoding="utf-8")


@pytest.mark.spec("ENG-042")
def test_eos_ids_come_from_both_configs(tmp_path: Path) -> None:
    write(tmp_path, "config.json", 5)
    write(tmp_path, "generation_config.json", [6, 7])
    assert eos_token_ids(tmp_path) == {5, 6, 7}


@pytest.mark.spec("ENG-042")
def test_eos_ids_from_the_generation_config_alone(tmp_path: Path) -> None:
    write(tmp_path, "generation_config.json", 9)
    assert eos_token_ids(tmp_path) == {9}


@pytest.mark.spec("ENG-042")
def test_no_eos_id_without_configs_or_with_null(tmp_path: Path) -> None:
    assert eos_token_ids(tmp_path) == frozenset()
    write(tmp_path, "config.json", None)
    assert eos_token_ids(tmp_path) == frozenset()


@pytest.mark.spec("ENG-060")
def test_a_directory_without_tokenizer_files_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="tokenizer"):
        Tokenizer(tmp_path)


@pytest.mark.spec("ENG-060")
def test_the_default_tokenizer_round_trips_and_templates_chats() -> None:
    from transformers import AutoTokenizer

    from pagedkv.assets import default_model_dir

    path = default_model_dir()
    ours, theirs = Tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    text = "def main():\n    return 0\n"
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == text
    assert ours.eos_token_id == theirs.eos_token_id
    assert ours.has_chat_template
    messages = [{"role": "user", "content": "Open a file."}]
    templated = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == ours.encode(templated)
    assert ours.decode(ours.apply_chat_template(messages)).endswith(
        "assistant\n"
    )  # skipped specials


@pytest.mark.spec("ENG-060", "ENG-042", "ENG-034")
@pytest.mark.parametrize("mode", ["v1", "v0"])
def test_an_engine_from_a_model_directory_is_wired_to_it(mode: CacheMode) -> None:
    """The engine gets the directory's tokenizer, EOS ids and trained positions, and (v1) a
    pool shaped by its config."""
    from pagedkv.assets import default_model_dir
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.engine import LLMEngine

    path = default_model_dir()
    config = EngineConfig(page_size=4, num_pages=16, mode=mode)
    engine = LLMEngine.from_model_dir(path, config)
    assert engine.tokenizer is not None
    assert engine.scheduler.eos_ids == eos_token_ids(path)
    assert engine.scheduler.eos_ids
    assert engine.runner.max_positions == 1024
    kv = getattr(engine.scheduler, "kv", None)
    if mode == "v1":
        assert kv is not None
        assert (kv.num_pages, kv.page_size) == (16, 4)
    else:
        assert kv is None
    prompt = engine.tokenizer.encode("import os\n")
    rid = engine.add_request("import os\n", SamplingParams(max_tokens=3, temperature=0.0))
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(o for o in engine.step() if o.request_id == rid)
    assert list(outputs[-1].prompt_token_ids) == prompt
    assert len(outputs[-1].token_ids) >= 1


@pytest.mark.spec("SRV-090")
def test_token_id_is_the_one_token_spelling_a_text() -> None:
    """What the reasoning parser asks of a tokenizer for each think tag: the id of the single
    vocabulary token spelling it, or ``None`` for a text of several tokens or none."""
    from pagedkv.assets import default_model_dir

    tokenizer = Tokenizer(default_model_dir())
    for tag in ("<|im_end|>", "<|im_start|>"):
        assert tokenizer.token_id(tag) == tokenizer.hf.convert_tokens_to_ids(tag)
    (word,) = tokenizer.encode("def")
    assert tokenizer.token_id("def") == word
    assert len(tokenizer.encode("<think>")) > 1
    assert tokenizer.token_id("<think>") is None
    assert tokenizer.token_id("") is None
