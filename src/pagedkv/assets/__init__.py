"""Files shipped inside the package: the small default model.

The default model is a tiny Qwen3-architecture checkpoint trained on Python source code
(see ``scripts/train_default_model.py``), with its byte-level BPE tokenizer and a ChatML chat
template. It is meant for demos and tests, not for useful answers.
"""

from __future__ import annotations

from pathlib import Path

#: Name the default model is served under when none is given.
DEFAULT_MODEL_NAME = "pagedkv-default"


def default_model_dir() -> Path:
    """Directory of the embedded default model (``config.json``, ``model.safetensors``,
    ``tokenizer.json``, ``tokenizer_config.json``). It may be absent from a source checkout
    where the model has not been built yet: see :func:`has_default_model`."""
    return Path(__file__).resolve().parent / "default_model"


def has_default_model() -> bool:
    """Whether the embedded default model's config and weights are present."""
    directory = default_model_dir()
    return (directory / "config.json").is_file() and (directory / "model.safetensors").is_file()
