"""``python -m pagedkv_bench.gguf_convert LLAMA_CPP_SRC MODEL_DIR OUTFILE OUTTYPE``: the bench
checkpoint's GGUF, written by llama.cpp's own converter (``convert_hf_to_gguf.py``).

Run by :func:`pagedkv_bench.llamacpp_peer.write_gguf` with pagedkv's interpreter (torch,
transformers and numpy are there) and the source tree first on the path, so the converter
imports its own ``conversion`` package and the ``gguf`` package bundled beside it (``gguf-py``,
version 0.19.0 in the tree the Makefile builds: the converter's default; the 0.19.0 release
on the package index lacks architectures this converter registers, and fails at import).

One step is replaced (ENG-212): the bench checkpoint has random weights and no tokenizer, and
the converter takes the vocabulary from the checkpoint's tokenizer files. Its Qwen3 vocabulary
step writes instead a byte-level BPE vocabulary of the checkpoint's ``vocab_size`` tokens
(:func:`synthetic_vocab`: GPT-2's 256 byte tokens first, as llama.cpp's BPE loader looks the
newline up among them, then placeholders, one merge), with the ``qwen2`` pre-tokenizer Qwen3's
checkpoints declare; every tensor, every hyperparameter and the file itself are the
converter's. The benchmark feeds token ids, never text, so the vocabulary's strings play no
part in what is timed. The file is written beside ``OUTFILE`` as ``OUTFILE.partial`` and
renamed once complete.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: The pre-tokenizer Qwen3's released checkpoints convert to.
PRE_TOKENIZER = "qwen2"


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode table: the 256 strings a byte-level BPE vocabulary spells each
    byte with, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = 0
    by_byte: dict[int, str] = {}
    for byte in range(256):
        if byte in printable:
            by_byte[byte] = chr(byte)
        else:
            by_byte[byte] = chr(256 + shifted)
            shifted += 1
    return [by_byte[b] for b in range(256)]


def synthetic_vocab(size: int) -> tuple[list[str], list[str]]:
    """``size`` distinct tokens (the 256 byte tokens, ``"ĠĠ"``, then ``<|pagedkv_N|>``
    placeholders) and one BPE merge (``"Ġ Ġ"``, making ``"ĠĠ"``).

    Raises:
        ValueError: ``size`` below 257 (the byte tokens and the merge's token).
    """
    if size < 257:
        raise ValueError(f"a byte-level vocabulary needs at least 257 tokens, not {size}")
    tokens = [*byte_tokens(), "ĠĠ"]
    tokens += [f"<|pagedkv_{i}|>" for i in range(len(tokens), size)]
    return tokens, ["Ġ Ġ"]


def _set_vocab(model: Any) -> None:
    """The replaced vocabulary step of the converter's Qwen3 model (``model`` is its
    ``Qwen3Model``; ``gguf`` is the converter's)."""
    gguf: Any = importlib.import_module("gguf")  # the converter's, on the path it set
    tokens, merges = synthetic_vocab(int(model.hparams["vocab_size"]))
    writer = model.gguf_writer
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(PRE_TOKENIZER)
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    writer.add_token_merges(merges)
    gguf.SpecialVocab(model.dir_model, load_merges=False).add_to_gguf(writer)


def convert(source: Path, model_dir: Path, outfile: Path, outtype: str) -> None:
    """Run the converter of the llama.cpp tree ``source`` on ``model_dir`` (its vocabulary
    step replaced), writing ``outfile`` in ``outtype`` (``f32`` or ``bf16``)."""
    sys.path.insert(0, str(source))
    # The converter first: importing it puts its bundled gguf-py on the path.
    converter: Any = importlib.import_module("convert_hf_to_gguf")
    qwen: Any = importlib.import_module("conversion.qwen")
    qwen.Qwen3Model.set_vocab = _set_vocab
    partial = outfile.with_name(outfile.name + ".partial")
    sys.argv = [
        "convert_hf_to_gguf.py",
        str(model_dir),
        "--outfile",
        str(partial),
        "--outtype",
        outtype,
    ]
    converter.main()
    partial.rename(outfile)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 4 or args[3] not in ("f32", "bf16"):
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    convert(Path(args[0]), Path(args[1]), Path(args[2]), args[3])
    return 0


if __name__ == "__main__":
    sys.exit(main())
