"""The ``pagedkv`` command line, run as a subprocess (SRV-040..SRV-046)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from serving_models import serving_model_dir

from pagedkv.assets import has_default_model
from pagedkv.backend import load_engine
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm import run_to_completion
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.interfaces import Engine
from pagedkv.testing.tiny_qwen3 import model_device

#: Engine flags every generate run passes; :data:`CONFIG` is the same configuration.
ENGINE_FLAGS = (
    *("--page-size", "8", "--num-pages", "64", "--max-model-len", "256"),
    *("--device", model_device()),
)
CONFIG = EngineConfig(page_size=8, num_pages=64, max_model_len=256)


def cli(
    *args: str, stdin: str | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m pagedkv ARGS``; stdout and stderr captured as UTF-8 text."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    return subprocess.run(
        [sys.executable, "-m", "pagedkv", *args],
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        encoding="utf-8",
        env=env,
        timeout=timeout,
        check=False,
    )


def one_line_error(result: subprocess.CompletedProcess[str], status: int) -> str:
    """The error line of a failed run: exactly one stderr line, no traceback (SRV-044)."""
    assert result.returncode == status, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "error" in lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return serving_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Engine:
    """The Python API on the same model and engine configuration."""
    return load_engine(model_dir, CONFIG, device=model_device())


def greedy(engine: Engine, prompts: list[str | list[int]], max_tokens: int) -> list[RequestOutput]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return run_to_completion(engine, prompts, params)


def json_lines(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


@pytest.mark.spec("SRV-040")
@pytest.mark.parametrize(
    ("command", "flags"),
    [
        ((), ("demo", "generate", "serve", "bench", "--debug")),
        (("demo",), ("--max-tokens", "--num-requests", "--no-progress")),
        (
            ("generate",),
            (
                "--model",
                "--prompt",
                "--jsonl",
                "--chat",
                "--stream",
                "--json",
                "--temperature",
                "--top-p",
                "--top-k",
                "--min-p",
                "--seed",
                "--stop",
                "--max-tokens",
                "--page-size",
                "--num-pages",
                "--max-num-seqs",
                "--max-num-batched-tokens",
                "--dtype",
                "--device",
                "--no-prefix-caching",
                "--max-step-retries",
            ),
        ),
        (("serve",), ("--model", "--host", "--port", "--max-body-bytes", "--served-model-name")),
        (("bench",), ("--quick", "--only", "results.json")),
    ],
)
def test_help(command: tuple[str, ...], flags: tuple[str, ...]) -> None:
    result = cli(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: pagedkv {' '.join(command)}".rstrip())
    for flag in flags:
        assert flag in result.stdout


@pytest.mark.spec("SRV-041", "SRV-043")
def test_generate_chat_prompts_json_matches_python_api(model_dir: Path, reference: Engine) -> None:
    prompts = ["def add(a, b):", "class Stack:"]
    system = "You write Python."
    args = ["generate", "--model", str(model_dir), "--chat", "--system", system, "--json"]
    for prompt in prompts:
        args += ["--prompt", prompt]
    result = cli(*args, "--max-tokens", "6", "--ignore-eos", *ENGINE_FLAGS)
    assert result.returncode == 0, result.stderr
    lines = json_lines(result.stdout)
    tokenizer = reference.tokenizer
    assert tokenizer is not None
    chats: list[str | list[int]] = [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": p}]
        )
        for p in prompts
    ]
    expected = greedy(reference, chats, 6)
    assert [line["prompt"] for line in lines] == prompts
    assert [line["token_ids"] for line in lines] == [list(o.token_ids) for o in expected]
    assert [line["text"] for line in lines] == [o.text for o in expected]
    assert all(line["finish_reason"] == "length" for line in lines)
    metrics = lines[0]["metrics"]
    assert metrics["prompt_tokens"] == len(chats[0])
    assert metrics["generated_tokens"] == 6
    assert metrics["ttft_s"] > 0


@pytest.mark.spec("SRV-041")
def test_generate_jsonl(model_dir: Path, reference: Engine, tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "hello"}]
    records: list[dict[str, Any]] = [
        {"prompt": "import os\n"},
        {"prompt": [5, 6, 7, 8, 9]},
        {"messages": messages},
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    result = cli(
        "generate",
        "--model",
        str(model_dir),
        "--jsonl",
        str(path),
        "--json",
        "--max-tokens",
        "5",
        "--ignore-eos",
        *ENGINE_FLAGS,
    )
    assert result.returncode == 0, result.stderr
    tokenizer = reference.tokenizer
    assert tokenizer is not None
    prompts: list[str | list[int]] = [
        "import os\n",
        [5, 6, 7, 8, 9],
        tokenizer.apply_chat_template(messages),
    ]
    expected = greedy(reference, prompts, 5)
    lines = json_lines(result.stdout)
    assert [line["token_ids"] for line in lines] == [list(o.token_ids) for o in expected]
    assert [line["prompt"] for line in lines] == [r.get("prompt", messages) for r in records]


@pytest.mark.spec("SRV-041", "SRV-042")
def test_generate_stdin_prompts_streamed(model_dir: Path, reference: Engine) -> None:
    prompts = ["def fibonacci(n):", "for i in range(10):"]
    result = cli(
        "generate",
        "--model",
        str(model_dir),
        "--stream",
        "--max-tokens",
        "7",
        "--ignore-eos",
        *ENGINE_FLAGS,
        stdin="\n".join(prompts) + "\n",
    )
    assert result.returncode == 0, result.stderr
    texts = [o.text for o in greedy(reference, list(prompts), 7)]
    assert result.stdout == "".join(f"### {i}\n{text}\n" for i, text in enumerate(texts))


@pytest.mark.spec("SRV-044")
def test_usage_errors_exit_2() -> None:
    line = one_line_error(cli("generate", "--no-such-flag"), 2)
    assert "--no-such-flag" in line
    line = one_line_error(cli("generate", "--max-tokens", "many"), 2)
    assert "--max-tokens" in line
    one_line_error(cli("generate", "--stream", "--json", "--prompt", "x"), 2)


@pytest.mark.spec("SRV-040", "ENG-072")
def test_max_step_retries_reaches_the_engine() -> None:
    from pagedkv.entrypoints.cli.engine_args import engine_config
    from pagedkv.entrypoints.cli.main import build_parser

    for command in ("generate", "serve"):
        default = build_parser().parse_args([command])
        assert engine_config(default).max_step_retries == EngineConfig().max_step_retries == 2
        given = build_parser().parse_args([command, "--max-step-retries", "0"])
        assert engine_config(given).max_step_retries == 0


@pytest.mark.spec("SRV-044", "SRV-041", "ENG-070")
@pytest.mark.parametrize("mode", ["--json", "--stream"])
def test_a_failed_prompt_is_reported_and_exits_1(
    mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every step holding the second prompt raises: it fails alone, named on stderr, and the
    first prompt's output is printed as usual."""
    from pagedkv.backend import reference_backend
    from pagedkv.entrypoints.cli import generate as cli_generate
    from pagedkv.entrypoints.cli.main import main
    from pagedkv.testing.faults import IdTokenizer, PoisonedRunner

    def faulty_engine(*_: Any) -> Engine:
        config = EngineConfig(page_size=4, num_pages=32, max_model_len=64)
        runner = PoisonedRunner(101, 32, 4, poison=(90, 91), kind="raise")
        return reference_backend().create_engine(runner, config, tokenizer=IdTokenizer())

    monkeypatch.setattr(cli_generate, "load_engine", faulty_engine)
    argv = ["generate", "--model", str(tmp_path), "--max-tokens", "3", "--temperature", "0"]
    status = main([*argv, "--prompt", "1 2 3", "--prompt", "90 91 5", mode])
    out, err = capsys.readouterr()
    assert status == 1
    (line,) = err.strip().splitlines()
    assert line.startswith("pagedkv generate: prompt 1 failed: 3 steps running it alone failed")
    assert "InjectedFault" in line
    if mode == "--json":
        first, second = (json.loads(x) for x in out.splitlines())
        assert (first["finish_reason"], first["error"]) == ("length", None)
        assert len(first["token_ids"]) == 3
        assert second["finish_reason"] == "error"
        assert second["error"] in line
        assert second["token_ids"] == []
    else:
        assert out.startswith("### 0\n")
        assert len(out.split("### 1\n")[0].split()) == 2 + 3  # the header, then 3 tokens


@pytest.mark.spec("SRV-044")
def test_runtime_errors_exit_1(tmp_path: Path) -> None:
    missing = tmp_path / "no-model-here"
    line = one_line_error(cli("generate", "--model", str(missing), "--prompt", "x"), 1)
    assert str(missing) in line
    assert "does not exist" in line
    line = one_line_error(cli("generate", "--prompt", "x", "--temperature", "-1"), 1)
    assert line.endswith("temperature must be >= 0, got -1.0")
    line = one_line_error(cli("generate", "--prompt", "x", "--top-p", "1.5"), 1)
    assert line.endswith("top_p must be in (0, 1], got 1.5")


@pytest.mark.spec("SRV-044")
def test_unknown_architecture_is_one_line(model_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "llama"
    shutil.copytree(model_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    config.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (copy / "config.json").write_text(json.dumps(config))
    line = one_line_error(cli("generate", "--model", str(copy), "--prompt", "x"), 1)
    assert "llama" in line.lower()


@pytest.mark.spec("SRV-045")
@pytest.mark.skipif(not has_default_model(), reason="the embedded default model is not built")
def test_demo() -> None:
    result = cli("demo", "--no-progress", "--max-tokens", "8", "--num-requests", "4")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert len(re.findall(r"^\[\d\] user: ", out, re.MULTILINE)) == 4
    hit = re.search(r"^prefix-cache hit rate\s+([\d.]+)%\s+([\d.]+)%$", out, re.MULTILINE)
    assert hit is not None, out
    assert float(hit.group(1)) > 0
    assert float(hit.group(2)) == 0
    saved = re.search(r"^prefill tokens saved\s+(\d+)\s+(\d+)$", out, re.MULTILINE)
    assert saved is not None
    assert int(saved.group(1)) > 0
    for row in (
        "time to first token (ms)",
        "prefill step time (s)",
        "wall time (s)",
        "generated tokens/s",
        "peak KV pages in use",
        "KV pages in use now",
    ):
        assert re.search(rf"^{re.escape(row)}\s+\S+\s+\S+$", out, re.MULTILINE), row
    saved_line = re.search(r"^prefix caching saved (\d+) prefill tokens and ", out, re.MULTILINE)
    assert saved_line is not None
    assert int(saved_line.group(1)) > 0
    assert re.search(r"^why the wall time moves( little|\s[\d.]+x): .*decode steps", out, re.M)
    assert "identical greedy outputs with prefix caching on and off: yes" in out


@pytest.mark.spec("SRV-046")
def test_bench_is_the_benchmark_command() -> None:
    result = cli("bench", "--help")
    assert result.returncode == 0
    for option in ("--quick", "--out", "--only"):
        assert option in result.stdout
    bad = cli("bench", "--only", "no-such-workload")
    assert bad.returncode == 2
    assert len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.spec("SRV-045")
def test_the_wall_time_line_follows_the_figures() -> None:
    """The sentence on the wall time says "moves little" only for a small speed-up, and calls
    a prefill cheap only when its steps cost under twice a decode step (a fixed sentence
    contradicted the figures next to it)."""
    from pagedkv.engine.outputs import EngineStats
    from pagedkv.entrypoints.cli.demo import BatchRun, why_wall_time_moves

    stats = EngineStats(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)

    def run(wall: float, prefill: list[float], decode: list[float]) -> BatchRun:
        return BatchRun([], wall, stats, prefill, decode)

    cheap = why_wall_time_moves(run(1.0, [0.01], [0.01] * 90), run(1.05, [0.012] * 4, [0.01] * 90))
    assert cheap.startswith("why the wall time moves little: ")
    assert "a prefill step costs little more than a decode step" in cheap
    costly = why_wall_time_moves(run(1.0, [0.1], [0.01] * 10), run(3.0, [0.5] * 4, [0.01] * 10))
    assert costly.startswith("why the wall time moves 3.00x: ")
    assert "a prefill step costs 50.0x a decode step" in costly
