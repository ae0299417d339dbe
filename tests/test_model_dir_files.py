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
    assert ours.decode(ours.apply_chat_template(messages)) == "user\nOpen a file.\nassistant\n"
    assert theirs.decode(ours.apply_chat_template(messages)) == templated  # specials skipped


@pytest.mark.spec("ENG-060", "ENG-042", "ENG-034")
@pytest.mark.parametrize("mode", ["v1", "v0"])
def test_an_engine_from_a_model_directory_is_wired_to_it(mode: CacheMode) -> None:
    """The engine gets the directory's tokenizer, EOS ids and trained positions, and (v1) a
    pool shaped by its config."""
    from pagedkv.assets import default_model_dir
    from pagedkv.backend import ReferenceBackend
    from pagedkv.engine.config import EngineConfig

    path = default_model_dir()
    config = EngineConfig(page_size=4, num_pages=16, mode=mode)
    engine = ReferenceBackend().load_engine(path, config)
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


@pytest.mark.spec("ENG-060", "ENG-081", "ENG-034")
def test_an_engine_from_a_model_directory_takes_its_config_and_dtype(tmp_path: Path) -> None:
    """The directory given (the embedded model's files, trained for 512 positions here), the
    config given and the dtype asked for."""
    import shutil

    import torch

    from pagedkv.assets import default_model_dir
    from pagedkv.backend import ReferenceBackend
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.runner import ModelRunner

    path = Path(shutil.copytree(default_model_dir(), tmp_path / "model"))
    hf_config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    hf_config["max_position_embeddings"] = 512
    (path / "config.json").write_text(json.dumps(hf_config), encoding="utf-8")
    config = EngineConfig(page_size=4, num_pages=8)
    engine = ReferenceBackend().load_engine(path, config, dtype="bfloat16")
    assert engine.config == config
    assert engine.runner.max_positions == 512
    assert isinstance(engine.runner, ModelRunner)
    assert next(engine.runner.model.parameters()).dtype == torch.bfloat16


@pytest.mark.spec("ENG-080")
@pytest.mark.parametrize("value", [True, "0.6", [0.6], None])
def test_a_generation_default_of_the_wrong_type_is_refused(tmp_path: Path, value: object) -> None:
    """A boolean, a string or a list is not a number (``null`` leaves the default)."""
    from pagedkv.engine.generation_config import GenerationDefaults

    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": value, "top_k": 5}), encoding="utf-8"
    )
    if value is None:
        assert GenerationDefaults.from_dir(tmp_path) == GenerationDefaults(top_k=5)
        return
    with pytest.raises(CheckpointError, match="temperature"):
        GenerationDefaults.from_dir(tmp_path)


@pytest.mark.spec("ENG-080")
def test_generation_defaults_refuse_a_field_sampling_params_lacks() -> None:
    from pagedkv.engine.generation_config import GenerationDefaults
    from pagedkv.errors import InvalidRequest

    defaults = GenerationDefaults(top_k=5)
    assert defaults.sampling_params(top_p=None).top_k == 5
    with pytest.raises(InvalidRequest, match="colour"):
        defaults.sampling_params(colour=1)


@pytest.mark.spec("ENG-146")
def test_a_generation_config_is_read_as_utf8_whatever_the_locale(tmp_path: Path) -> None:
    """Under an ASCII locale (no UTF-8 mode), a file with non-ASCII text is still read."""
    import os
    import subprocess
    import sys

    import pagedkv

    (tmp_path / "generation_config.json").write_text(
        json.dumps({"_comment": "défaut", "top_k": 5}, ensure_ascii=False), encoding="utf-8"
    )
    src = str(Path(pagedkv.__file__).absolute().parents[1])  # the package imported here
    env = {
        **os.environ,
        "LC_ALL": "C",
        "LANG": "C",
        "PYTHONUTF8": "0",
        "PYTHONCOERCECLOCALE": "0",
        "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
    }
    code = (
        "import locale, sys\n"
        "from pagedkv.engine.generation_config import GenerationDefaults\n"
        "assert locale.getpreferredencoding(False).lower() != 'utf-8'\n"
        "print(GenerationDefaults.from_dir(sys.argv[1]).top_k)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "5"


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


def copy_tokenizer(directory: Path, *names: str) -> dict[str, object]:
    """Copy the embedded model's tokenizer files ``names`` into ``directory``; its
    ``tokenizer.json``, parsed."""
    import shutil

    from pagedkv.assets import default_model_dir

    source = default_model_dir()
    for name in names:
        shutil.copy(source / name, directory / name)
    parsed: dict[str, object] = json.loads((source / "tokenizer.json").read_text("utf-8"))
    return parsed


@pytest.mark.spec("ENG-060")
def test_a_tokenizer_from_either_of_its_files(tmp_path: Path) -> None:
    """``tokenizer.json`` alone is a tokenizer, and so is ``tokenizer_config.json`` with the
    vocabulary files it needs (a slow tokenizer's ``vocab.json`` and ``merges.txt``)."""
    from pagedkv.assets import default_model_dir

    text = "def main():\n    return 0\n"
    expected = Tokenizer(default_model_dir()).encode(text)
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    fast.mkdir()
    slow.mkdir()
    copy_tokenizer(fast, "tokenizer.json")
    assert Tokenizer(fast).encode(text) == expected
    model = copy_tokenizer(slow)["model"]
    assert isinstance(model, dict)
    (slow / "vocab.json").write_text(json.dumps(model["vocab"]), "utf-8")
    merges = ["#version: 0.2", *(" ".join(pair) for pair in model["merges"])]
    (slow / "merges.txt").write_text("\n".join(merges) + "\n", "utf-8")
    (slow / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "Qwen2Tokenizer"}), "utf-8"
    )
    assert Tokenizer(slow).encode(text) == expected


@pytest.mark.spec("ENG-060")
def test_prompts_are_tokenized_without_special_tokens_added(tmp_path: Path) -> None:
    """A tokenizer whose post-processor adds a BOS token: text and chat prompts are tokenized
    without it (a chat template writes every special token itself)."""
    parsed = copy_tokenizer(tmp_path, "tokenizer_config.json", "special_tokens_map.json")
    parsed["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}]
        + [{"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {
            "<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}
        },
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(parsed), "utf-8")
    tokenizer = Tokenizer(tmp_path)
    with_bos = tokenizer.hf.encode("def")
    assert with_bos[0] == 1
    assert tokenizer.encode("def") == with_bos[1:]
    messages = [{"role": "user", "content": "hi"}]
    chat = tokenizer.apply_chat_template(messages)
    assert chat[:2] == [1, tokenizer.encode("user")[0]]  # one <|im_start|>, the template's


@pytest.mark.spec("ENG-092")
def test_the_decoder_asked_for_is_the_decoder_given() -> None:
    """``DecodeStream`` for a fast tokenizer; the sliding window when asked, or for a tokenizer
    without a ``tokenizers`` backend."""
    from pagedkv.assets import default_model_dir
    from pagedkv.engine.detokenizer import DecodeStreamDecoder, WindowDecoder

    tokenizer = Tokenizer(default_model_dir())
    assert isinstance(tokenizer.incremental_decoder(), DecodeStreamDecoder)
    assert isinstance(tokenizer.incremental_decoder(window=False), DecodeStreamDecoder)
    assert isinstance(tokenizer.incremental_decoder(window=True), WindowDecoder)

    class Slow:
        """The same tokenizer seen without its ``tokenizers`` backend."""

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return str(tokenizer.hf.decode(ids, skip_special_tokens=skip_special_tokens))

    slow = Tokenizer(default_model_dir())
    slow._tok = Slow()
    assert isinstance(slow.incremental_decoder(), WindowDecoder)
    ids = tokenizer.encode("<|im_start|>def main():")
    step = slow.incremental_decoder()
    assert "".join(step(t) for t in ids) == "def main():"


@pytest.mark.spec("ENG-080")
def test_a_directory_without_a_generation_config_gives_no_defaults(tmp_path: Path) -> None:
    """A model directory need not hold ``generation_config.json``: no defaults, not an error,
    unless the file was asked for."""
    from pagedkv.engine.generation_config import GenerationDefaults

    assert GenerationDefaults.from_dir(tmp_path) == GenerationDefaults()
    with pytest.raises(CheckpointError, match=r"generation_config\.json"):
        GenerationDefaults.from_dir(tmp_path, required=True)
