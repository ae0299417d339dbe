"""How a tensor-parallel engine starts, fails and ends: ``LLM(tensor_parallel_size=2)``,
``torchrun``, ``pagedkv serve --tensor-parallel-size 2``, a worker killed or stopped, and no
process left behind (specs/tensor-parallel.md, TP-020..023)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_harness import post_json, running
from torch_threads import one_torch_thread  # noqa: F401  (autouse: one torch thread)

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm import LLM
from pagedkv.engine.params import SamplingParams
from pagedkv.entrypoints.server.app import ServerConfig, create_app
from pagedkv.errors import InvalidRequest, RunnerFailed, WorkerFailed
from pagedkv.interfaces import Engine
from pagedkv.parallel.group import WorkerGroup
from pagedkv.parallel.runner import TensorParallelRunner
from pagedkv.testing.tiny_qwen3 import build_tiny_checkpoint, preset_spec

BIN = Path(sys.executable).parent
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 42, 7, 99, 3, 11], [200, 1, 64], [8] * 13]
#: A bound on how long a failure may take to surface (the tests' collective timeout is 3 s).
FAILURE_BOUND_S = 20.0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(preset_spec("tied-gqa4-bias"), tmp_path_factory.mktemp("tp"))


@pytest.fixture(scope="module")
def expected(model: Path) -> list[list[int]]:
    with LLM(model, num_pages=64, page_size=4) as llm:
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux ``/proc``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def gone(pid: int, within_s: float) -> bool:
    """Whether process ``pid`` has exited (or is a zombie) within ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def worker_pids(llm: LLM) -> list[int]:
    runner = llm.engine.runner
    assert isinstance(runner, TensorParallelRunner)
    return [p.pid for p in runner.group.processes if p.pid is not None]


@pytest.mark.spec("TP-020", "TP-023")
def test_llm_starts_its_workers_and_ends_them(model: Path, expected: list[list[int]]) -> None:
    with LLM(model, num_pages=64, page_size=4, tensor_parallel_size=2) as llm:
        pids = worker_pids(llm)
        assert len(pids) == 1
        assert pids[0] in children(os.getpid())
        got = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        runner = llm.engine.runner
        assert isinstance(runner, TensorParallelRunner)
    assert got == expected
    assert [p.exitcode for p in runner.group.processes] == [0]  # left when told to
    assert gone(pids[0], 0.0)
    llm.close()  # twice: nothing more
    with pytest.raises(RunnerFailed, match="closed"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)


@pytest.mark.spec("TP-022")
def test_a_killed_worker_ends_the_engine(model: Path) -> None:
    llm = LLM(model, num_pages=64, page_size=4, tensor_parallel_size=2)
    try:
        engine = llm.engine
        first = engine.add_request(PROMPTS[0], GREEDY)
        engine.step()
        engine.add_request(PROMPTS[1], GREEDY)
        (pid,) = worker_pids(llm)
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerFailed) as info:
            step_until_it_raises(engine)
        assert time.monotonic() - start < FAILURE_BOUND_S
        assert info.value.rank == 1
        assert info.value.exitcode == -signal.SIGKILL
        assert "rank 1" in str(info.value)
        assert engine.stats().pages_in_use == 0  # every unfinished request failed, freed
        assert engine.abort(first) is None  # already ended
        with pytest.raises(WorkerFailed):
            engine.step()
        with pytest.raises(WorkerFailed):
            engine.add_request(PROMPTS[2], GREEDY)
    finally:
        llm.close()


def step_until_it_raises(engine: Engine) -> None:
    for _ in range(100):
        engine.step()
    raise AssertionError("100 steps ran with a dead worker")


@pytest.mark.spec("TP-022")
def test_a_stopped_worker_times_out(model: Path) -> None:
    """A worker that neither answers nor dies: the step fails once the collective timeout
    has passed, and the stopped process is ended."""
    group = WorkerGroup.spawn(2, threads=1, collective_timeout_s=3.0)
    runner = TensorParallelRunner.load(group, model, num_pages=16, page_size=4, owns_group=True)
    try:
        from pagedkv.backend import ReferenceBackend

        engine = ReferenceBackend().create_engine(runner, EngineConfig(page_size=4, num_pages=16))
        engine.add_request(PROMPTS[0], GREEDY)
        engine.step()
        (process,) = group.processes
        assert process.pid is not None
        os.kill(process.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerFailed, match="collective"):
            engine.step()
        assert 3.0 <= time.monotonic() - start < FAILURE_BOUND_S
        assert gone(process.pid, 10.0)
    finally:
        runner.close()


@pytest.mark.spec("TP-023")
def test_workers_leave_when_rank_0_dies(model: Path) -> None:
    script = (
        "import os, sys\n"
        "from pagedkv.engine.llm import LLM\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM({str(model)!r}, num_pages=16, page_size=4, tensor_parallel_size=2)\n"
        "    print(llm.engine.runner.group.processes[0].pid, flush=True)\n"
        "    os._exit(9)\n"  # no atexit, no close: the worker is orphaned
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 9, result.stderr
    pid = int(result.stdout.split()[0])
    assert gone(pid, FAILURE_BOUND_S), f"worker {pid} outlived its rank 0"


TORCHRUN_SCRIPT = """\
import json, sys
from pagedkv.engine.llm import LLM
from pagedkv.engine.params import SamplingParams

llm = LLM(sys.argv[1], num_pages=64, page_size=4, tensor_parallel_size=2)
params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
outputs = llm.generate(json.loads(sys.argv[2]), params, use_tqdm=False)
print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outputs]), flush=True)
llm.close()
"""


@pytest.mark.spec("TP-021")
def test_torchrun_runs_the_same_entry_point(
    model: Path, expected: list[list[int]], tmp_path: Path
) -> None:
    script = tmp_path / "generate.py"
    script.write_text(TORCHRUN_SCRIPT)
    command = [
        str(BIN / "torchrun"),
        "--nnodes=1",
        "--nproc-per-node=2",
        f"--master-port={free_port()}",
        str(script),
        str(model),
        json.dumps(PROMPTS),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("TOKENS ")]
    assert len(lines) == 1  # rank 0 alone generates; rank 1 served it and left
    assert json.loads(lines[0].removeprefix("TOKENS ")) == expected


@pytest.mark.spec("TP-021")
def test_a_size_other_than_the_world_is_refused(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(InvalidRequest, match=r"tensor_parallel_size=2.*WORLD_SIZE=1"):
        LLM(model, num_pages=16, page_size=4, tensor_parallel_size=2)


@pytest.mark.spec("TP-020", "TP-023")
def test_serve_with_two_ranks(expected_default: str) -> None:
    """``pagedkv serve --tensor-parallel-size 2`` serves the embedded model with one rank's
    greedy text; stopping the server ends its worker."""
    port = free_port()
    server = subprocess.Popen(
        [
            str(BIN / "pagedkv"),
            "serve",
            "--tensor-parallel-size",
            "2",
            "--port",
            str(port),
            "--num-pages",
            "64",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, server)
        workers = children(server.pid)
        assert len(workers) >= 1
        body = {"prompt": DEFAULT_PROMPT, "max_tokens": 16, "temperature": 0}
        response = post_json(f"{url}/v1/completions", body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected_default
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal
        assert "leaving" not in (server.stderr.read() if server.stderr else "")
        for pid in workers:
            assert gone(pid, FAILURE_BOUND_S), f"worker {pid} outlived the server"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(30)


DEFAULT_PROMPT = "def read_config(path):\n"


@pytest.fixture(scope="module")
def expected_default() -> str:
    with LLM(num_pages=64) as llm:
        (output,) = llm.generate([DEFAULT_PROMPT], SamplingParams(max_tokens=16, temperature=0))
    return output.outputs[0].text


def wait_healthy(url: str, server: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(
                f"the server exited: {server.stderr.read() if server.stderr else ''}"
            )
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not become healthy")


@pytest.mark.spec("TP-022")
def test_a_server_whose_worker_dies(model: Path) -> None:
    """The request in flight fails, the engine stops, ``/health`` answers 503."""
    llm = LLM(model, num_pages=64, page_size=4, tensor_parallel_size=2)
    engine: Engine = llm.engine
    try:
        app = create_app(engine, "tiny", config=ServerConfig(log_stats_interval_s=None))
        with running(app) as server:
            ok = post_json(f"{server.url}/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4})
            assert ok.status_code == 200, ok.text
            (pid,) = worker_pids(llm)
            os.kill(pid, signal.SIGKILL)
            assert gone(pid, 10.0)
            failed = post_json(
                f"{server.url}/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 4}
            )
            assert failed.status_code >= 500
            assert "rank 1" in failed.text
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 503
            after = post_json(
                f"{server.url}/v1/completions", {"prompt": PROMPTS[2], "max_tokens": 4}
            )
            assert after.status_code == 503
    finally:
        llm.close()


@pytest.mark.spec("TP-003")
def test_the_command_line_refuses_a_size_below_one(capsys: pytest.CaptureFixture[str]) -> None:
    from pagedkv.entrypoints.cli.main import main

    status = main(["generate", "--tensor-parallel-size", "0", "--prompt", "x", "--max-tokens", "2"])
    assert status == 1
    assert "tensor_parallel_size must be >= 1, got 0" in capsys.readouterr().err
