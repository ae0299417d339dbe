"""Model directories for the server and CLI tests.

``tiny_chat_model`` writes a tiny seeded Qwen3 checkpoint plus a small byte-level BPE tokenizer
with a ChatML chat template: fast to load, deterministic, and enough for text prompts, chat and
stop strings. The embedded default model is used where a test needs a trained model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv.assets import default_model_dir, has_default_model
from pagedkv.testing.tiny_qwen3 import TinySpec, build_tiny_checkpoint

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CORPUS = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "import os\nimport sys\n\nclass Config:\n"
    "    def __init__(self, path):\n        self.path = path\n",
    "The quick brown fox jumps over the lazy dog. Hello, world! How are you today?\n",
    "for i in range(10):\n    print(i, i * i)\nwhile True:\n    break\n",
)


def write_tokenizer(
    directory: Path, vocab_size: int = 320, chat_template: str = CHAT_TEMPLATE
) -> int:
    """Train a byte-level BPE tokenizer on :data:`CORPUS` into ``directory``; returns its
    vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(CORPUS) * 4, trainer=trainer)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return int(tok.get_vocab_size())


def tiny_chat_model(directory: Path) -> Path:
    """A tiny Qwen3 checkpoint (no EOS id: generation always runs to ``max_tokens``) with a
    tokenizer whose vocabulary is exactly the model's."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(directory)
    build_tiny_checkpoint(TinySpec(vocab=vocab, seed=7), directory)
    return directory


def tool_chat_model(directory: Path) -> Path:
    """:func:`tiny_chat_model` with Qwen3's own chat template, which renders tools, tool
    calls and tool results."""
    from qwen3_template import QWEN3_CHAT_TEMPLATE

    directory.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(directory, chat_template=QWEN3_CHAT_TEMPLATE)
    # Qwen3's tool prompt is some 600 of this small vocabulary's tokens.
    build_tiny_checkpoint(TinySpec(vocab=vocab, seed=7, max_position_embeddings=2048), directory)
    return directory


def serving_model_dir(factory: pytest.TempPathFactory) -> Path:
    """The embedded default model when it is present, else a tiny chat model in a temp dir."""
    if has_default_model():
        return default_model_dir()
    return tiny_chat_model(factory.mktemp("tiny-chat-model"))
