"""vLLM's request fields and command line on ``pagedkv serve`` (specs/serving.md SRV-118..SRV-122).

The per-field checks of both endpoints are tests/test_server_fields.py's (SRV-100); here: the
walk of OpenAI's and vLLM's request schemas against the declared fields, priority under the
priority policy, content parts that are not text, the noted fields' log lines, and the
command line's vLLM flags, ``--config``, a busy port and the load's progress.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_harness import error_of, post_json, running
from serving_models import serving_model_dir

from pagedkv.backend import load_engine
from pagedkv.engine.config import EngineConfig
from pagedkv.entrypoints.cli.config_file import expand_config
from pagedkv.entrypoints.cli.engine_args import engine_args, model_of
from pagedkv.entrypoints.cli.main import build_parser
from pagedkv.entrypoints.server.app import create_app
from pagedkv.entrypoints.server.listen import CannotListen, bind_listener
from pagedkv.entrypoints.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedkv.entrypoints.server.request_checks import noted_fields, refused_fields
from pagedkv.model.loader import load_model
from pagedkv.testing.tiny_qwen3 import model_device

#: Fields of the request schemas left to the tool-calling and structured-output change, which
#: declares them; until then an undeclared one is logged as ignored (SRV-053).
LEFT_TO_TOOL_CALLING = frozenset({"parallel_tool_calls"})
#: vLLM's own request fields (its ``ChatCompletionRequest`` and ``CompletionRequest`` beyond
#: OpenAI's), as of vLLM 0.11, but those of structured outputs and tool calling.
VLLM_FIELDS = {
    "completions": {
        "use_beam_search",
        "top_k",
        "min_p",
        "repetition_penalty",
        "length_penalty",
        "stop_token_ids",
        "include_stop_str_in_output",
        "ignore_eos",
        "min_tokens",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "truncate_prompt_tokens",
        "allowed_token_ids",
        "prompt_logprobs",
        "add_special_tokens",
        "response_format",
        "priority",
        "request_id",
        "logits_processors",
        "return_tokens_as_token_ids",
        "return_token_ids",
        "cache_salt",
        "kv_transfer_params",
        "vllm_xargs",
        "bad_words",
    },
    "chat": {
        "best_of",
        "use_beam_search",
        "top_k",
        "min_p",
        "repetition_penalty",
        "length_penalty",
        "stop_token_ids",
        "include_stop_str_in_output",
        "ignore_eos",
        "min_tokens",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "truncate_prompt_tokens",
        "prompt_logprobs",
        "allowed_token_ids",
        "bad_words",
        "echo",
        "add_generation_prompt",
        "continue_final_message",
        "add_special_tokens",
        "documents",
        "chat_template",
        "chat_template_kwargs",
        "mm_processor_kwargs",
        "priority",
        "request_id",
        "logits_processors",
        "return_tokens_as_token_ids",
        "return_token_ids",
        "cache_salt",
        "kv_transfer_params",
        "vllm_xargs",
    },
}
ENDPOINTS = {"completions": CompletionRequest, "chat": ChatCompletionRequest}


def openai_fields(endpoint: str) -> set[str]:
    """The request fields of OpenAI's own client for ``endpoint``."""
    if endpoint == "completions":
        from openai.types import completion_create_params as params
    else:
        from openai.types.chat import completion_create_params as params  # type: ignore[no-redef]
    return set(params.CompletionCreateParamsBase.__annotations__)


@pytest.mark.spec("SRV-118", "SRV-100")
@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_every_openai_and_vllm_field_is_declared(endpoint: str) -> None:
    """Every field of OpenAI's request schema (from its client) and of vLLM's is declared,
    so the SRV-100 walk proves it honored, refused or noted: none is accepted and dropped.
    Fails when a field is left to the undeclared path (logged and ignored)."""
    declared = set(ENDPOINTS[endpoint].model_fields)
    wanted = (openai_fields(endpoint) | VLLM_FIELDS[endpoint]) - LEFT_TO_TOOL_CALLING
    assert wanted <= declared, sorted(wanted - declared)


@pytest.mark.spec("SRV-118")
def test_noted_fields_change_nothing_and_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    """The fields OpenAI defines as the caller's records (user, metadata, ...) are noted: in
    neither the refused nor a sampling field, and logged with the request's id."""
    from pagedkv.entrypoints.server.request_checks import log_noted

    for model in ENDPOINTS.values():
        noted = set(noted_fields(model))
        assert {"user", "metadata", "safety_identifier", "prompt_cache_key"} <= noted
        assert not noted & set(refused_fields(model))
    body = CompletionRequest(prompt="x", user="alice", metadata={"team": "a"})
    with caplog.at_level(logging.INFO, logger="pagedkv.server"):
        log_noted(body, "cmpl-1")
    assert "request cmpl-1: metadata={'team': 'a'}, user='alice'" in caplog.text


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return serving_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def priority_server(model_dir: Path) -> Iterator[str]:
    config = EngineConfig(
        page_size=8, num_pages=64, max_model_len=256, scheduling_policy="priority"
    )
    app = create_app(load_engine(model_dir, config, device=model_device()), "m", 1 << 20)
    with running(app) as server:
        yield server.url


def chat_body(**fields: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "temperature": 0,
        **fields,
    }


@pytest.mark.spec("SRV-118")
def test_priority_is_served_under_the_priority_policy(priority_server: str) -> None:
    """A server scheduling by priority takes any priority (the fcfs server refuses one other
    than 0, tests/test_server_fields.py); the same greedy text whatever the priority."""
    url = f"{priority_server}/v1/chat/completions"
    low = post_json(url, chat_body(priority=5))
    high = post_json(url, chat_body(priority=-5))
    assert low.status_code == high.status_code == 200, (low.text, high.text)
    content = [r.json()["choices"][0]["message"]["content"] for r in (low, high)]
    assert content[0] == content[1]


@pytest.mark.spec("SRV-118")
@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "file", "file": {"file_id": "f"}},
    ],
)
def test_a_content_part_that_is_not_text_says_text_only(priority_server: str, part: Any) -> None:
    """An image, audio or file part is a 400 saying the model takes text only, naming the
    part, not a schema error listing union members."""
    body = chat_body()
    body["messages"] = [{"role": "user", "content": [{"type": "text", "text": "see"}, part]}]
    error = error_of(post_json(f"{priority_server}/v1/chat/completions", body), 400)
    assert "this model takes text only" in error["message"]
    assert error["param"] == "messages.0.content.1"


# -- the command line ------------------------------------------------------------------------------


def parsed(*argv: str) -> Any:
    return build_parser().parse_args(expand_config(list(argv)))


@pytest.mark.spec("SRV-120")
def test_serve_takes_vllms_flags_and_a_positional_model(tmp_path: Path) -> None:
    """``serve MODEL`` and vLLM's flags reach the engine arguments, the old spellings too."""
    args = parsed(
        "serve",
        str(tmp_path),
        "--gpu-memory-utilization",
        "0.8",
        "--no-enable-prefix-caching",
        "--max-model-len",
        "512",
        "--dtype",
        "half",
        "--seed",
        "3",
        "--served-model-name",
        "name",
        "--chat-template",
        "{{ messages }}",
        "--scheduling-policy",
        "priority",
        "--trust-remote-code",
        "--enforce-eager",
    )
    assert model_of(args) == str(tmp_path)
    chosen = engine_args(args)
    assert (chosen.gpu_memory_utilization, chosen.enable_prefix_caching) == (0.8, False)
    assert (chosen.max_model_len, chosen.dtype, chosen.seed) == (512, "float16", 3)
    assert (chosen.chat_template, chosen.scheduling_policy) == ("{{ messages }}", "priority")
    assert args.served_model_name == "name"
    old = engine_args(parsed("serve", "--page-size", "8", "--no-prefix-caching"))
    assert (old.block_size, old.enable_prefix_caching) == (8, False)
    assert engine_args(parsed("serve", "--enable-prefix-caching")).enable_prefix_caching


@pytest.mark.spec("SRV-120")
def test_config_file_gives_flags_the_command_line_overrides(tmp_path: Path) -> None:
    """``--config FILE`` (YAML, keys with _ or -) sets flags; a flag on the command line
    wins; a broken file is a usage error naming it."""
    config = tmp_path / "serve.yaml"
    config.write_text("max_model_len: 300\nblock-size: 8\nenable_prefix_caching: false\nport: 9\n")
    args = parsed("serve", "--config", str(config), "--max-model-len", "400")
    chosen = engine_args(args)
    assert (chosen.max_model_len, chosen.block_size, chosen.enable_prefix_caching) == (
        400,
        8,
        False,
    )
    assert args.port == 9
    (tmp_path / "bad.yaml").write_text("- a list\n")
    result = cli("serve", "--config", str(tmp_path / "bad.yaml"))
    assert result.returncode == 2
    assert "bad.yaml" in result.stderr


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pagedkv", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.spec("SRV-120")
def test_help_shows_the_effective_defaults() -> None:
    """``serve --help`` names vLLM's flags and the context default as the model's (1024 for
    the embedded model), not a fixed number the server does not use."""
    result = cli("serve", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "default: the model's max_position_embeddings; 1024 for the embedded model" in text
    for flag in ("--gpu-memory-utilization", "--enable-prefix-caching", "--config", "MODEL"):
        assert flag in text


@pytest.mark.spec("SRV-119")
def test_a_negative_seed_is_refused_by_the_command_line() -> None:
    """``--seed -1`` is refused as the API refuses it (status 2, naming --seed)."""
    for command in ("serve", "generate"):
        result = cli(command, "--seed", "-1")
        assert result.returncode == 2, result.stderr
        assert "--seed" in result.stderr
        assert "[0, 2**64 - 1]" in result.stderr


@pytest.mark.spec("SRV-121")
def test_a_busy_port_fails_before_the_model_loads(tmp_path: Path) -> None:
    """With the port held by another socket, serve exits 1 at once with one line naming the
    address; it never gets to the model (a missing one, which loading would report)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        started = time.monotonic()
        result = cli("serve", "--port", str(port), "--model", str(tmp_path / "nothing-here"))
        elapsed = time.monotonic() - started
        with pytest.raises(CannotListen, match="in use"):
            bind_listener("127.0.0.1", port)
    assert result.returncode == 1, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in result.stderr
    assert "nothing-here" not in result.stderr  # the missing model was never looked at
    assert elapsed < 60


@pytest.mark.spec("SRV-122")
def test_loading_shows_progress(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The loader draws a bar over the checkpoint's tensors when asked (on a terminal by
    default), and none when told not to."""
    load_model(model_dir, progress=True)
    err = capsys.readouterr().err
    assert "loading weights" in err
    assert "tensor" in err
    load_model(model_dir, progress=False)
    assert capsys.readouterr().err == ""
