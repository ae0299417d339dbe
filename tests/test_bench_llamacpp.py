"""llama.cpp as a peer of the benchmarks (ENG-210..213), without llama.cpp: the command lines,
the parsing of ``llama-batched-bench``'s output, the GGUF conversion call through a stand-in
source tree, the peer skipped with its reason, and the long-context row."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagedkv.bench.context import BenchContext
from pagedkv.bench.requests import BenchRequest
from pagedkv.bench.results import WorkloadResult
from pagedkv_bench import gguf_convert, llamacpp_peer, peers
from pagedkv_bench.llamacpp_peer import LlamaCppInstall, LlamaCppPeer, PeerUnavailable, RowShape

#: ``llama-batched-bench``'s JSON line of one row, as it prints it (values made up).
ROW_LINE = (
    '{"n_kv_max": 1528, "n_batch": 4096, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, '
    '"n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 128, "tg": 63, "pl": 8, '
    '"n_kv": 1528, "t_pp": 2.000000, "speed_pp": 512.0, "t_tg": 6.000000, "speed_tg": 84.0, '
    '"t": 8.000000, "speed": 191.0}'
)

#: A stand-in ``llama-batched-bench``: records its arguments, prints a log line and the row
#: its -npp/-ntg/-npl ask for (prefill 0.5 s, decode 0.1 s per step), or fails on demand.
FAKE_BINARY = """#!{python}
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_LLAMA_ARGS"], "w") as f:
    json.dump(args, f)
if os.environ.get("FAKE_LLAMA_FAIL"):
    print("error: the fake model did not load", file=sys.stderr)
    sys.exit(3)
value = {{args[i]: args[i + 1] for i in range(0, len(args) - 1)}}
pp, tg, pl = int(value["-npp"]), int(value["-ntg"]), int(value["-npl"])
print("main: n_kv_max = 1528, n_batch = 4096", file=sys.stderr)
row = {{"pp": pp, "tg": tg, "pl": pl, "t_pp": 0.5, "t_tg": 0.1 * tg}}
print(json.dumps(row), file=sys.stderr)
"""


def fake_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> LlamaCppInstall:
    """An install folder with the stand-in binary and an f32 GGUF already written."""
    install = LlamaCppInstall(tmp_path / "llamacpp")
    install.batched_bench.parent.mkdir(parents=True)
    install.batched_bench.write_text(FAKE_BINARY.format(python=sys.executable))
    install.batched_bench.chmod(0o755)
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    gguf = install.gguf(checkpoint, "float32")
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv(llamacpp_peer.DIR_ENV, str(install.root))
    monkeypatch.setenv("FAKE_LLAMA_ARGS", str(tmp_path / "args.json"))
    return install


@pytest.mark.spec("ENG-210")
def test_without_the_binary_the_peer_is_skipped_naming_the_install_target(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A bench without llama.cpp built records why in the workload's notes and measures the
    others; catches a peer that crashes the workload or vanishes without a word."""
    monkeypatch.setenv(llamacpp_peer.DIR_ENV, str(tmp_path / "nothing-here"))
    with pytest.raises(PeerUnavailable, match="make llamacpp-install"):
        LlamaCppPeer(tmp_path, "float32", threads=1, batch_tokens=64)
    result = WorkloadResult("peers")
    ctx = BenchContext(quick=False, threads=1, verbose=False)
    checkpoint = SimpleNamespace(path=tmp_path)
    assert peers._llama_cpp(ctx, result, checkpoint, "float32") is None  # type: ignore[arg-type]
    assert len(result.notes) == 1
    assert "llama.cpp (float32) not measured" in result.notes[0]
    assert "make llamacpp-install" in result.notes[0]


@pytest.mark.spec("ENG-210")
def test_a_binary_without_gguf_or_converter_is_unavailable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The binary alone cannot run a row: without the GGUF and the converter to write it the
    peer says so; catches a peer that would start the binary on a missing model."""
    install = fake_install(tmp_path, monkeypatch)
    with pytest.raises(PeerUnavailable, match=r"no llama\.cpp converter"):
        LlamaCppPeer(tmp_path / "ckpt", "bfloat16", threads=1, batch_tokens=64, install=install)


@pytest.mark.spec("ENG-211")
def test_the_command_line_carries_the_rows_threads_lengths_budget_and_dtype() -> None:
    """Catches a row run with other threads, another prompt or decode length, a context too
    small for the row (llama.cpp skips such a row silently) or its K/V cache in another dtype."""
    install = LlamaCppInstall(Path("/opt/llama"))
    shape = llamacpp_peer.row_shape([BenchRequest(tuple(range(128)), 64)] * 8)
    assert shape == RowShape(8, 128, 64)
    command = llamacpp_peer.bench_command(
        install, Path("m.gguf"), shape, dtype="bfloat16", threads=2, batch_tokens=4096
    )
    assert command[0] == str(install.batched_bench)
    flags = dict(zip(command[1::2], command[2::2], strict=True))
    assert flags == {
        "-m": "m.gguf",
        "-t": "2",
        "-tb": "2",
        "-c": str(8 * (128 + 63)),
        "-b": "4096",
        "-ctk": "bf16",
        "-ctv": "bf16",
        "-npp": "128",
        "-ntg": "63",
        "-npl": "8",
        "--output-format": "jsonl",
    }


@pytest.mark.spec("ENG-211")
def test_rows_it_cannot_run_are_refused() -> None:
    """Catches a row of mixed lengths run as if uniform, or a row with no decode step (whose
    decode rate would divide by zero)."""
    with pytest.raises(PeerUnavailable, match="share their lengths"):
        llamacpp_peer.row_shape([BenchRequest((1, 2), 4), BenchRequest((1, 2, 3), 4)])
    with pytest.raises(PeerUnavailable, match="share their lengths"):
        llamacpp_peer.row_shape([BenchRequest((1, 2), 4), BenchRequest((3, 4), 5)])
    with pytest.raises(PeerUnavailable, match="no decode step"):
        llamacpp_peer.row_shape([BenchRequest((1, 2), 1)])
    with pytest.raises(PeerUnavailable, match="no GGUF type"):
        llamacpp_peer.gguf_type("float16")


@pytest.mark.spec("ENG-211")
def test_the_row_line_gives_wall_with_prefill_and_decode_rates() -> None:
    """8 requests of 64 tokens: 512 output tokens over t_pp + t_tg = 8 s, each sequence's 63
    decoded tokens over t_tg = 6 s; other rows' lines and log lines are skipped. Catches a
    wall without the prefill, a count of the -ntg tokens as the output, or another row's
    line taken."""
    shape = RowShape(8, 128, 64)
    other = ROW_LINE.replace('"pl": 8', '"pl": 32')
    output = f"main: log line\n{other}\n{ROW_LINE}\nllama_perf_context_print: ..."
    run = llamacpp_peer.parse_row(output, shape)
    assert run.system == llamacpp_peer.LLAMA_CPP
    assert run.output_tokens == 512
    assert run.wall_s == pytest.approx(8.0)
    assert run.tokens_per_s == pytest.approx(64.0)
    assert run.decode_tokens_per_s == pytest.approx(63 / 6.0)
    with pytest.raises(PeerUnavailable, match="printed no row"):
        llamacpp_peer.parse_row(other + "\nthe end", shape)
    with pytest.raises(PeerUnavailable, match="malformed"):
        llamacpp_peer.parse_row("{not json", shape)


@pytest.mark.spec("ENG-211")
def test_a_run_starts_the_binary_and_reads_its_row(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Through a stand-in binary: the peer runs it with the row's command and reads the row
    from its log stream; a failing binary is unavailable with its last words. Catches a peer
    that reads only standard output (llama.cpp logs its rows to standard error) or hides the
    binary's failure."""
    fake_install(tmp_path, monkeypatch)
    peer = LlamaCppPeer(tmp_path / "ckpt", "float32", threads=2, batch_tokens=4096)
    run = peer.run([BenchRequest(tuple(range(16)), 11)])
    args = json.loads((tmp_path / "args.json").read_text())
    assert args[args.index("-ntg") + 1] == "10"
    assert args[args.index("-npp") + 1] == "16"
    assert args[args.index("-m") + 1] == str(peer.gguf)
    assert run.decode_tokens == (10,)
    assert run.decode_tokens_per_s == pytest.approx(10.0)
    assert run.wall_s == pytest.approx(1.5)
    monkeypatch.setenv("FAKE_LLAMA_FAIL", "1")
    with pytest.raises(PeerUnavailable, match=r"exited with 3.*did not load"):
        peer.run([BenchRequest(tuple(range(16)), 11)])


#: A stand-in llama.cpp source tree: its converter builds a Qwen3 model of the checkpoint's
#: config and calls the model class's vocabulary step with a recording writer, then writes
#: what it recorded (and its arguments) to its --outfile.
FAKE_CONVERTER = """
import json, sys
from pathlib import Path
import conversion.qwen

class Writer:
    def __init__(self):
        self.calls = {}
    def __getattr__(self, name):
        return lambda value: self.calls.__setitem__(name, value)

def main():
    args = sys.argv[1:]
    model_dir, out = Path(args[0]), Path(args[args.index("--outfile") + 1])
    model = conversion.qwen.Qwen3Model()
    model.dir_model = model_dir
    model.hparams = json.loads((model_dir / "config.json").read_text())
    model.gguf_writer = Writer()
    model.set_vocab()
    out.write_text(json.dumps({"args": args, "calls": model.gguf_writer.calls}))
"""
FAKE_GGUF_PACKAGE = """
class TokenType:
    NORMAL = 1

class SpecialVocab:
    def __init__(self, path, load_merges):
        self.load_merges = load_merges
    def add_to_gguf(self, writer):
        writer.add_special("from the checkpoint's config")
"""


def fake_source(root: Path) -> None:
    (root / "conversion").mkdir(parents=True)
    (root / "conversion" / "__init__.py").write_text("")
    (root / "conversion" / "qwen.py").write_text(
        "class Qwen3Model:\n    def set_vocab(self):\n        raise RuntimeError('no tokenizer')\n"
    )
    (root / "gguf").mkdir()
    (root / "gguf" / "__init__.py").write_text(FAKE_GGUF_PACKAGE)
    (root / "convert_hf_to_gguf.py").write_text(FAKE_CONVERTER)


@pytest.mark.spec("ENG-212")
def test_the_gguf_is_written_by_the_trees_converter_with_a_synthetic_vocabulary(
    tmp_path: Path,
) -> None:
    """Through a stand-in source tree: the converter of that tree runs on the checkpoint with
    the dtype's --outtype, writing a .partial file then renamed, its vocabulary step replaced
    by the checkpoint-sized BPE vocabulary; a GGUF older than the weights is written again.
    Catches a conversion that leaves a half-written GGUF under the final name, the tokenizer
    step left to fail on a checkpoint without a tokenizer, or a stale GGUF reused."""
    install = LlamaCppInstall(tmp_path / "llamacpp")
    fake_source(install.source)
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"vocab_size": 300}))
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    command = llamacpp_peer.convert_command(install, checkpoint, "bfloat16")
    assert command[:3] == [sys.executable, "-m", "pagedkv_bench.gguf_convert"]
    assert command[3:] == [
        str(install.source),
        str(checkpoint),
        str(install.gguf(checkpoint, "bfloat16")),
        "bf16",
    ]
    target = llamacpp_peer.write_gguf(install, checkpoint, "bfloat16")
    written = json.loads(target.read_text())
    assert written["args"] == [
        str(checkpoint),
        "--outfile",
        str(target) + ".partial",
        "--outtype",
        "bf16",
    ]
    calls = written["calls"]
    assert calls["add_tokenizer_model"] == "gpt2"
    assert calls["add_tokenizer_pre"] == "qwen2"
    assert len(calls["add_token_list"]) == 300 == len(set(calls["add_token_list"]))
    assert calls["add_token_types"] == [1] * 300
    assert calls["add_token_merges"] == ["Ġ Ġ"]
    assert calls["add_special"] == "from the checkpoint's config"
    assert not target.with_name(target.name + ".partial").exists()
    target.write_text("kept")  # newer than the weights: reused
    assert llamacpp_peer.write_gguf(install, checkpoint, "bfloat16").read_text() == "kept"
    old = target.stat().st_mtime - 60
    os.utime(target, (old, old))  # older than the weights: written again
    assert llamacpp_peer.write_gguf(install, checkpoint, "bfloat16").read_text() != "kept"


@pytest.mark.spec("ENG-212")
def test_a_failing_converter_is_unavailable_with_its_last_words(tmp_path: Path) -> None:
    """Catches a failed conversion taken for a GGUF, or reported without its cause."""
    install = LlamaCppInstall(tmp_path / "llamacpp")
    fake_source(install.source)
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()  # no config.json: the stand-in converter fails reading it
    with pytest.raises(PeerUnavailable, match=r"converter failed.*config\.json"):
        llamacpp_peer.write_gguf(install, checkpoint, "float32")
    assert not install.gguf(checkpoint, "float32").exists()


@pytest.mark.spec("ENG-212")
def test_the_synthetic_vocabulary_starts_with_gpt2s_byte_tokens() -> None:
    """llama.cpp's BPE loader finds the newline among the byte tokens ('Ċ'); catches a table
    that is not GPT-2's, or a vocabulary of the wrong size."""
    tokens, merges = gguf_convert.synthetic_vocab(151936)
    assert len(tokens) == 151936 == len(set(tokens))
    assert tokens[ord("\n")] == "Ċ"
    assert tokens[ord(" ")] == "Ġ"
    assert tokens[ord("a")] == "a"
    assert len(set(tokens[:256])) == 256
    first, second = merges[0].split(" ")
    assert first + second in tokens
    with pytest.raises(ValueError, match="at least 257"):
        gguf_convert.synthetic_vocab(256)


@pytest.mark.spec("ENG-213")
def test_the_long_context_row_runs_on_the_engines_and_fits_them() -> None:
    """Catches a long row missing, run by transformers generate, or larger than the engines'
    max_model_len or K/V capacity."""
    long_rows = [r for r in peers.rows() if r.prompt_len == peers.LONG_PROMPT_LEN]
    assert [r.name for r in long_rows] == ["fp32_decode_long", "bf16_decode_long"]
    row = long_rows[0]
    assert row.batch == 1
    assert row.metric == "decode_tokens_per_s"
    assert not row.runs_on(peers.HF)
    assert all(row.runs_on(s) for s in (peers.PAGEDKV, peers.VLLM, peers.LLAMA_CPP))
    (request,) = row.requests(1000, 0)
    assert len(request.prompt) == 4096
    assert request.max_tokens == peers.NEW_TOKENS
    assert peers.MAX_MODEL_LEN >= 4096 + peers.NEW_TOKENS
    assert peers.kv_positions() >= 32 * (128 + 64)
    assert peers.kv_positions() >= 4096 + 64


@pytest.mark.spec("ENG-211", "ENG-213")
def test_the_ratios_pair_llama_cpp_and_skip_generate_on_the_long_row() -> None:
    """Each row's ratio against llama.cpp is the median of the repetitions' ratios, the decode
    rows also report the lowest; the long row has no ratio against generate. Catches medians
    of unpaired figures, a missing target, or a ratio over a system that never ran the row."""
    samples: peers.Samples = {r.name: {} for r in peers.rows()}
    samples["fp32_decode"] = {
        peers.PAGEDKV: [10.0, 8.0, 9.0, 12.0],
        peers.LLAMA_CPP: [10, 10, 9, 8],
    }
    samples["fp32_decode_long"] = {peers.PAGEDKV: [6.0, 6.0, 6.0], peers.LLAMA_CPP: [5, 4, 6]}
    result = WorkloadResult("peers")
    peers._ratios(result, samples)
    assert result.ratios["peers.fp32_decode_pagedkv_vs_llama_cpp"] == pytest.approx(1.0)
    assert result.ratios["peers.fp32_decode_pagedkv_vs_llama_cpp_lowest"] == pytest.approx(0.8)
    assert result.ratios["peers.fp32_decode_long_pagedkv_vs_llama_cpp"] == pytest.approx(1.2)
    assert "peers.fp32_decode_long_pagedkv_vs_hf_generate" not in result.ratios
    assert "peers.fp32_decode_long_pagedkv_vs_vllm_cpu" in result.ratios
    targets = {t.ratio: t.threshold for t in result.targets}
    assert targets["peers.fp32_decode_long_pagedkv_vs_llama_cpp"] == 1.0
    assert targets["peers.bf16_bs32_pagedkv_vs_llama_cpp"] == 1.0
    assert targets["peers.bf16_decode_pagedkv_vs_llama_cpp_lowest"] == 0.9
