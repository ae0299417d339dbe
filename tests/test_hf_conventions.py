"""Hugging Face conventions (specs/engine.md ENG-080..082): a checkpoint's sampling defaults,
``dtype="auto"`` and hub ids from the local cache, never the network.

The hub cache is a fake one in a temp dir (``$HF_HUB_CACHE``), laid out as ``huggingface_hub``
lays it out: ``models--owner--name/refs/main`` naming a snapshot directory.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from serving_models import tiny_chat_model

from pagedkv import LLM, SamplingParams
from pagedkv.engine.generation_config import GenerationDefaults
from pagedkv.entrypoints.cli.engine_args import resolve_model_dir
from pagedkv.errors import CheckpointError
from pagedkv.model_source import resolve_dtype

GENERATION = {"temperature": 0.0, "top_k": 5, "max_new_tokens": 3, "do_sample": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny chat model shipping sampling defaults and a bfloat16 dtype in its config."""
    directory = tiny_chat_model(tmp_path_factory.mktemp("tiny-defaults"))
    (directory / "generation_config.json").write_text(json.dumps(GENERATION))
    config = json.loads((directory / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def write_generation_config(directory: Path, values: dict[str, object]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps(values))
    return directory


@pytest.mark.spec("ENG-080")
def test_the_models_defaults_apply_when_the_request_gives_none(model_dir: Path) -> None:
    """No SamplingParams: greedy and 3 tokens, as generation_config.json says; given params
    win; ``vllm`` turns the defaults off."""
    llm = LLM(model_dir, num_pages=32)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.0, 5, 3)
    assert defaults.top_p == SamplingParams().top_p  # not in the file: the library's
    (out,) = llm.generate("def f", use_tqdm=False)
    assert len(out.token_ids) == 3
    (greedy,) = llm.generate("def f", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert out.token_ids == greedy.token_ids
    llm.engine.add_request("def f")  # the engine takes the same defaults
    finals = []
    while llm.engine.has_unfinished_requests():
        finals += [o for o in llm.engine.step() if o.finished]
    assert [o.token_ids for o in finals] == [greedy.token_ids]
    (given,) = llm.generate("def f", SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)
    assert len(given.token_ids) == 5
    assert GenerationDefaults.load("vllm", model_dir) == GenerationDefaults()


@pytest.mark.spec("ENG-080")
def test_a_generation_config_directory_and_bad_values(model_dir: Path, tmp_path: Path) -> None:
    other = write_generation_config(tmp_path / "other", {"top_p": 0.5, "repetition_penalty": 1.2})
    loaded = GenerationDefaults.load(str(other), model_dir)
    assert loaded.sampling_params().top_p == 0.5
    assert loaded.sampling_params(top_p=0.9).top_p == 0.9
    assert loaded.sampling_params().repetition_penalty == 1.2
    with pytest.raises(CheckpointError, match=r"generation_config\.json"):
        GenerationDefaults.load(str(tmp_path / "missing"), model_dir)
    bad = write_generation_config(tmp_path / "bad", {"top_k": 2.5})
    with pytest.raises(CheckpointError, match="top_k"):
        GenerationDefaults.load(str(bad), model_dir)


@pytest.mark.spec("ENG-081")
def test_dtype_auto_takes_the_checkpoints(model_dir: Path, tmp_path: Path) -> None:
    llm = LLM(model_dir, num_pages=16, dtype="auto", generation_config="vllm")
    assert llm.get_default_sampling_params().top_k == SamplingParams().top_k  # "vllm": not 5
    runner = llm.engine.runner
    assert next(runner.model.parameters()).dtype == torch.bfloat16  # type: ignore[attr-defined]
    assert llm.generate("def f", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
    for config, want in [
        ({"torch_dtype": "float16"}, "float16"),
        ({"dtype": "float32", "torch_dtype": "bfloat16"}, "float32"),
        ({}, "float32"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert resolve_dtype("auto", tmp_path) == want
    assert resolve_dtype("float16", model_dir) == "float16"
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float64"}))
    with pytest.raises(CheckpointError, match="float64"):
        resolve_dtype("auto", tmp_path)


def fake_hub_cache(root: Path, repo_id: str, snapshot_of: Path) -> Path:
    """A hub cache under ``root`` holding ``repo_id`` at revision ``main``."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123456789abcdef")
    shutil.copytree(snapshot_of, repo / "snapshots" / "0123456789abcdef")
    return root


@pytest.mark.spec("ENG-082")
def test_hub_ids_come_from_the_local_cache_only(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``acme/tiny`` in the cache loads; ``acme/absent`` is a one-line error naming it; no
    request leaves the machine (the endpoint is unroutable)."""
    cache = fake_hub_cache(tmp_path / "hub", "acme/tiny", model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    llm = LLM("acme/tiny", num_pages=16, generation_config="vllm")
    assert llm.generate("x", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
    assert resolve_model_dir("acme/tiny").parent.parent.name == "models--acme--tiny"
    with pytest.raises(CheckpointError) as error:
        LLM("acme/absent")
    message = str(error.value)
    assert "'acme/absent'" in message
    assert "\n" not in message
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # $HF_HOME/hub is the same cache
    assert resolve_model_dir("acme/tiny").is_dir()
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_model_dir("./no/such/dir")
