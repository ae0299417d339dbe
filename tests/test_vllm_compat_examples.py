"""The structured-output and tool-call example scripts run as vLLM scripts on a tiny Qwen3
checkpoint with Qwen3's chat template (ENG-061, ENG-190, ENG-196): each is run as
``__main__`` with the checkpoint as its argument."""

from __future__ import annotations

import ast
import json
import re
import runpy
from pathlib import Path

import pytest
from serving_models import tool_chat_model

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "vllm_compat"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tool_chat_model(tmp_path_factory.mktemp("vllm-compat-tools"))


def run_example(
    name: str, checkpoint: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> str:
    """The script's stdout, run as ``python examples/vllm_compat/NAME CHECKPOINT``."""
    script = EXAMPLES / name
    monkeypatch.setattr("sys.argv", [str(script), str(checkpoint)])
    runpy.run_path(str(script), run_name="__main__")
    return capsys.readouterr().out


@pytest.mark.spec("ENG-061", "ENG-190")
def test_structured_output_example(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The script's JSON parses (it would raise otherwise) and each constraint's output
    matches it. Catches: SamplingParams refusing structured_outputs, or a constraint
    dropped."""
    out = run_example("structured_output.py", checkpoint, monkeypatch, capsys)
    assert out.startswith("JSON: {")
    found = dict(re.findall(r"^(\w+): (.*)$", out, re.MULTILINE))
    assert re.fullmatch(r"[a-z]+@[a-z]+\.com", ast.literal_eval(found["regex"]))
    assert ast.literal_eval(found["choice"]) in ("positive", "negative")
    assert re.fullmatch(r"SELECT [a-z]{1,8} FROM users", ast.literal_eval(found["grammar"]))


@pytest.mark.spec("ENG-061", "ENG-196")
def test_tool_call_example(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A call of get_weather with one of its cities, the tool's result, an answer.
    Catches: LLM.chat refusing tools, or tool messages refused by the template path."""
    out = run_example("tool_call.py", checkpoint, monkeypatch, capsys)
    call = re.search(r"^Tool call: get_weather\((.*)\)$", out, re.MULTILINE)
    assert call is not None, out
    assert json.loads(call.group(1))["city"] in ("Paris", "Oslo", "Lima")
    assert "Tool result: " in out
    assert "Answer: " in out
