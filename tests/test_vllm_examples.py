"""The vLLM-style example scripts run unchanged on a tiny checkpoint (ENG-061).

``examples/vllm_compat`` holds scripts written as vLLM's, only the import line differing; each
is run here as ``__main__`` with the checkpoint as its argument (in this interpreter, which
has torch loaded already), on a tiny Qwen3 checkpoint with a tokenizer.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
from serving_models import tiny_chat_model

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "vllm_compat"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_chat_model(tmp_path_factory.mktemp("vllm-compat-model"))


def run_example(
    name: str,
    checkpoint: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> str:
    """The script's stdout, run as ``python examples/vllm_compat/NAME CHECKPOINT``."""
    script = EXAMPLES / name
    monkeypatch.setattr("sys.argv", [str(script), str(checkpoint)])
    runpy.run_path(str(script), run_name="__main__")
    return capsys.readouterr().out


@pytest.mark.spec("ENG-061", "ENG-186")
def test_offline_generate_with_logprobs(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Three prompts, each with its generated text and one log-probability line per token
    read as vLLM's ``logprobs[i][token].logprob`` (a tuple shape would fail the script)."""
    out = run_example("offline_generate.py", checkpoint, monkeypatch, capsys)
    assert out.count("Prompt: ") == 3
    assert out.count(" logprob ") == 3 * 16
    assert "cumulative logprob" in out


@pytest.mark.spec("ENG-061", "ENG-188")
def test_chat(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """One conversation then a batch of two, through the chat template."""
    out = run_example("chat.py", checkpoint, monkeypatch, capsys)
    assert out.count("Generated text: ") == 3
    assert "Prompt tokens: " in out


@pytest.mark.spec("ENG-061")
def test_only_the_import_line_differs_from_vllm() -> None:
    """Every example imports pagedkv on one line, marked with vLLM's import (a structured
    outputs example also imports ``StructuredOutputsParams`` from ``pagedkv.sampling_params``,
    vLLM's ``vllm.sampling_params``), and nothing else of pagedkv: swapping those lines runs
    it on vLLM."""
    swap = "from pagedkv import LLM, SamplingParams  # vLLM: from vllm import LLM, SamplingParams"
    params = (
        "from pagedkv.sampling_params import StructuredOutputsParams"
        "  # vLLM: from vllm.sampling_params"
    )
    for script in EXAMPLES.glob("*.py"):
        lines = [line for line in script.read_text().splitlines() if "pagedkv" in line]
        code = [line for line in lines if line.startswith(("from ", "import "))]
        assert code in ([swap], [swap, params]), script
