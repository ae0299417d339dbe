"""Thinking mode: ``chat_template_kwargs`` reach the chat template (Python API and server), and
``--reasoning-parser qwen3`` returns the thinking as ``reasoning_content``, streamed as its own
deltas (SRV-090..SRV-095).

The tokenizer is the tests' tiny byte-level BPE with Qwen3's ``<think>`` and ``</think>`` added as
(non-special) tokens, and a ChatML template that, like Qwen3's, closes an empty think block in
the prompt when ``enable_thinking`` is false (and, like a thinking-only checkpoint's, opens one
when ``open_thinking`` is true). The server's model is a scripted runner replying a fixed
completion to each known prompt, so the split can be checked exactly.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from serving_models import write_tokenizer

from pagedkv.engine.chat_template import InvalidTemplateKwargs
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.llm import LLM
from pagedkv.engine.tokenizer import Tokenizer
from pagedkv.entrypoints.server.app import ServerConfig, create_app
from pagedkv.errors import InvalidRequest
from pagedkv.plan import StepPlan
from pagedkv.testing.tiny_qwen3 import TinySpec, build_tiny_checkpoint

MODEL = "thinker"
THINKING = ServerConfig(reasoning_parser="qwen3", log_stats_interval_s=None)
QWEN3_LIKE_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- if open_thinking is defined and open_thinking %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)
MESSAGES = [{"role": "user", "content": "How are you today?"}]
#: What the model thinks and answers. The thought starts without the newline the opening tag
#: of ``open_thinking`` is followed by, so that the scripted prompts stay apart.
THOUGHT, ANSWER = "The quick brown fox.\n", "\n\nHello, world!"


def thinking_tokenizer(directory: Path) -> int:
    """The tests' tokenizer plus ``<think>``/``</think>`` and the template; its vocab size."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as RawTokenizer

    directory.mkdir(parents=True, exist_ok=True)
    write_tokenizer(directory)
    raw = RawTokenizer.from_file(str(directory / "tokenizer.json"))
    raw.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    raw.save(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN3_LIKE_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return int(raw.get_vocab_size())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 checkpoint (for the Python API) with the thinking tokenizer."""
    directory = tmp_path_factory.mktemp("thinker")
    vocab = thinking_tokenizer(directory)
    build_tiny_checkpoint(TinySpec(vocab=vocab, seed=7), directory)
    return directory


class ScriptRunner:
    """A v0 model that continues each known prompt with its scripted completion."""

    def __init__(self, vocab_size: int, completions: dict[tuple[int, ...], list[int]]) -> None:
        self._vocab = vocab_size
        self._completions = completions

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def max_positions(self) -> None:
        return None

    def next_token(self, context: list[int]) -> int:
        """The script of the longest known prompt ``context`` starts with."""
        for prompt, completion in sorted(self._completions.items(), key=lambda p: -len(p[0])):
            if tuple(context[: len(prompt)]) == prompt:
                return completion[len(context) - len(prompt)]
        raise AssertionError(f"no script for context {context}")

    def execute(self, plan: StepPlan) -> torch.Tensor:
        starts = plan.attention.query_start.tolist()
        logits = torch.zeros(len(starts) - 1, self._vocab)
        for row, (start, stop) in enumerate(itertools.pairwise(starts)):
            logits[row, self.next_token(plan.input_ids[start:stop].tolist())] = 10.0
        return logits


def scripted_engine(model_dir: Path) -> LLMEngine:
    """A v0 engine on the scripted model: it thinks then answers by default, answers at once
    with ``enable_thinking`` false, and closes the thought the prompt opened with
    ``open_thinking``."""
    tokenizer = Tokenizer(model_dir)
    end = tokenizer.token_id("<|im_end|>")
    think, unthink = tokenizer.token_id("<think>"), tokenizer.token_id("</think>")
    assert end is not None
    assert think is not None
    assert unthink is not None

    def prompt(**kwargs: object) -> tuple[int, ...]:
        return tuple(tokenizer.apply_chat_template(MESSAGES, kwargs))

    words = tokenizer.encode
    completions = {
        prompt(): [think, *words(THOUGHT), unthink, *words(ANSWER), end],
        prompt(enable_thinking=False): [*words(ANSWER.strip()), end],
        prompt(open_thinking=True): [*words(THOUGHT.strip()), unthink, *words(ANSWER), end],
    }
    vocab = 1 + max(t for c in completions.values() for t in c)
    runner = ScriptRunner(vocab, completions)
    config = EngineConfig(mode="v0", max_model_len=256)
    return LLMEngine(runner, config, tokenizer=tokenizer, eos_ids=frozenset({end}))


@pytest.fixture(scope="module")
def app(model_dir: Path) -> Any:
    """The server on the scripted model, with the qwen3 reasoning parser."""
    return create_app(scripted_engine(model_dir), MODEL, 1 << 16, config=THINKING)


@pytest.fixture(scope="module")
def client(app: Any) -> Iterator[TestClient]:
    """One client for the module: an app's engine thread starts once."""
    with TestClient(app) as test_client:
        yield test_client


def chat(client: TestClient, stream: bool = False, **kwargs: Any) -> Any:
    body: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "temperature": 0, **kwargs}
    if not stream:
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as events:
        assert events.status_code == 200
        lines = [line[len("data: ") :] for line in events.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def joined(chunks: list[Any], field: str) -> str | None:
    """A field's deltas concatenated, ``None`` if no chunk carried it."""
    parts = [c["choices"][0]["delta"].get(field) for c in chunks if c["choices"]]
    values = [p for p in parts if p]
    return "".join(values) if values else None


# -- chat_template_kwargs -------------------------------------------------------------------------


@pytest.mark.spec("SRV-093")
def test_python_chat_passes_template_kwargs(model_dir: Path) -> None:
    llm = LLM(model_dir, num_pages=32, page_size=8, max_model_len=128)
    tokenizer = llm.engine.tokenizer
    assert tokenizer is not None
    params_kwargs = {"enable_thinking": False}
    (plain,) = llm.chat(MESSAGES, use_tqdm=False)
    (off,) = llm.chat(MESSAGES, use_tqdm=False, chat_template_kwargs=params_kwargs)
    plain_text = tokenizer._tok.decode(list(plain.prompt_token_ids))
    off_text = tokenizer._tok.decode(list(off.prompt_token_ids))
    assert off_text == plain_text + "<think>\n\n</think>\n\n"
    with pytest.raises(InvalidTemplateKwargs, match="'enable_thinkin'"):
        llm.chat(MESSAGES, use_tqdm=False, chat_template_kwargs={"enable_thinkin": False})
    with pytest.raises(InvalidRequest, match="'add_generation_prompt'"):
        llm.chat(MESSAGES, use_tqdm=False, chat_template_kwargs={"add_generation_prompt": False})


@pytest.mark.spec("SRV-093")
def test_server_passes_template_kwargs_and_refuses_unread_ones(client: TestClient) -> None:
    on = chat(client)["usage"]["prompt_tokens"]
    off = chat(client, chat_template_kwargs={"enable_thinking": False})["usage"]["prompt_tokens"]
    assert off > on
    body = {"model": MODEL, "messages": MESSAGES, "chat_template_kwargs": {"thinking": True}}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "chat_template_kwargs"
    assert "'thinking'" in error["message"]
    assert "enable_thinking" in error["message"]


# -- the reasoning parser -------------------------------------------------------------------------


@pytest.mark.spec("SRV-090", "SRV-091")
@pytest.mark.parametrize(
    ("kwargs", "reasoning", "content"),
    [
        ({}, THOUGHT, ANSWER),
        ({"enable_thinking": False}, None, ANSWER.strip()),
        ({"open_thinking": True}, THOUGHT.strip(), ANSWER),
    ],
    ids=["thinking", "enable_thinking-false", "opened-in-prompt"],
)
def test_reasoning_content_apart_streamed_or_not(
    client: TestClient, kwargs: dict[str, Any], reasoning: str | None, content: str
) -> None:
    extra = {"chat_template_kwargs": kwargs} if kwargs else {}
    message = chat(client, **extra)["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (reasoning, content)
    chunks = chat(client, stream=True, **extra)
    assert joined(chunks, "reasoning_content") == reasoning
    assert joined(chunks, "content") == content
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert not any(d.get("reasoning_content") and d.get("content") for d in deltas[1:-1])
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.spec("SRV-094")
def test_without_a_parser_the_thinking_stays_in_the_content(
    model_dir: Path, tmp_path: Path
) -> None:
    app = create_app(scripted_engine(model_dir), MODEL, 1 << 16)
    with TestClient(app) as plain:
        message = chat(plain)["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": f"<think>{THOUGHT}</think>{ANSWER}",
        "reasoning_content": None,
        "tool_calls": [],  # vLLM's message carries its (here no) tool calls
    }
    write_tokenizer(tmp_path)  # the tests' tokenizer, without think tokens
    engine = LLMEngine(ScriptRunner(8, {}), EngineConfig(mode="v0"), tokenizer=Tokenizer(tmp_path))
    with pytest.raises(InvalidRequest, match="'<think>'"):
        create_app(engine, MODEL, 1 << 16, config=THINKING)


@pytest.mark.spec("SRV-095")
def test_serve_reasoning_parser_flag(tmp_path: Path) -> None:
    def serve(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pagedkv", "serve", *args],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    assert "--reasoning-parser" in serve("--help").stdout
    unknown = serve("--reasoning-parser", "r1")
    assert unknown.returncode == 2
    assert "--reasoning-parser" in unknown.stderr
    directory = tmp_path / "model"
    directory.mkdir()
    vocab = write_tokenizer(directory)
    build_tiny_checkpoint(TinySpec(vocab=vocab), directory)
    missing = serve("--model", str(directory), "--reasoning-parser", "qwen3", "--port", "0")
    assert missing.returncode == 1
    lines = missing.stderr.strip().splitlines()
    assert len(lines) == 1, missing.stderr
    assert "'<think>'" in lines[0]
