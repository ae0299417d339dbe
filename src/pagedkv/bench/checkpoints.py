"""The checkpoints the benchmarks run: the small default model and a Qwen3-0.6B-shaped one.

* The small model is the embedded default model when the package ships it; otherwise a
  stand-in of the same shape with seeded random weights, built once into the cache folder.
* The Qwen3-0.6B-shaped checkpoint has the real model's shapes (about 0.6 billion parameters,
  2.4 GB in float32) and seeded random weights. Decode speed does not depend on the values, so
  it measures what the real model would cost without downloading it. It is generated once into
  the cache folder: the model is built on the meta device for its tensor names and shapes, and
  each tensor is then filled from a seeded generator and saved with safetensors.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pagedkv.assets import default_model_dir, has_default_model
from pagedkv.testing.tiny_qwen3 import TinySpec, build_tiny_checkpoint

#: Shape of the embedded default model (see ``scripts/train_default_model.py``).
SMALL_STANDIN = TinySpec(
    vocab=4096,
    hidden=256,
    layers=6,
    heads=4,
    kv_heads=2,
    head_dim=64,
    intermediate=768,
    tie_word_embeddings=True,
    max_position_embeddings=1024,
    seed=0,
)

#: Marker file written last, naming the spec a generated checkpoint was built from.
SPEC_FILE = "bench_spec.json"


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A checkpoint directory and how the results name it.

    Attributes:
        path: Hugging Face format directory (``config.json``, ``model.safetensors``).
        name: short name for the results, e.g. ``default-model``.
        description: one line for the results' machine section.
    """

    path: Path
    name: str
    description: str


def small_checkpoint(cache_dir: Path) -> Checkpoint:
    """The embedded default model, or its same-shaped random stand-in when it is absent."""
    if has_default_model():
        return Checkpoint(default_model_dir(), "default-model", "embedded default model (trained)")
    path = cache_dir / "small-standin"
    spec = asdict(SMALL_STANDIN)
    if not _spec_matches(path, spec):
        shutil.rmtree(path, ignore_errors=True)
        build_tiny_checkpoint(SMALL_STANDIN, path)
        _write_spec(path, spec)
    return Checkpoint(path, "small-standin", "random weights in the default model's shape")


@dataclass(frozen=True, slots=True)
class Qwen3Shape:
    """Shapes of a Qwen3 checkpoint with random weights (defaults: Qwen3-0.6B).

    Attributes:
        vocab: vocabulary size.
        hidden: residual width.
        layers: decoder layers.
        heads: query heads.
        kv_heads: key/value heads.
        head_dim: channels per head.
        intermediate: MLP width.
        tie_word_embeddings: whether the LM head is the embedding table.
        rope_theta: RoPE base.
        max_position_embeddings: positions the config declares.
        init_std: standard deviation of the random weights (norm weights are 1).
        seed: seed of the weights.
        architecture: the config's ``architectures`` entry, as a released checkpoint has it
            (vLLM picks its runner from it: without one it served the model as an embedder).
    """

    vocab: int = 151936
    hidden: int = 1024
    layers: int = 28
    heads: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 3072
    tie_word_embeddings: bool = True
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    init_std: float = 0.02
    seed: int = 0
    architecture: str = "Qwen3ForCausalLM"


#: The Qwen3-0.6B shape.
QWEN3_0_6B = Qwen3Shape()


def qwen3_shaped_checkpoint(cache_dir: Path, shape: Qwen3Shape = QWEN3_0_6B) -> Checkpoint:
    """The random-weight checkpoint of ``shape``, generated once into ``cache_dir``."""
    path = cache_dir / f"qwen3-shape-h{shape.hidden}-l{shape.layers}-v{shape.vocab}"
    spec = asdict(shape)
    if not _spec_matches(path, spec):
        _generate(shape, path)
        _write_spec(path, spec)
    return Checkpoint(path, "qwen3-0.6b-shape", "Qwen3-0.6B shapes, random weights")


def _hf_config(shape: Qwen3Shape) -> Any:
    from pagedkv.testing.tiny_qwen3 import TinySpec, hf_config

    return hf_config(
        TinySpec(
            vocab=shape.vocab,
            hidden=shape.hidden,
            layers=shape.layers,
            heads=shape.heads,
            kv_heads=shape.kv_heads,
            head_dim=shape.head_dim,
            intermediate=shape.intermediate,
            tie_word_embeddings=shape.tie_word_embeddings,
            rope_theta=shape.rope_theta,
            seed=shape.seed,
            max_position_embeddings=shape.max_position_embeddings,
        )
    )


def _generate(shape: Qwen3Shape, path: Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` for ``shape`` (float32)."""
    from safetensors.torch import save_file
    from transformers import Qwen3ForCausalLM

    config = _hf_config(shape)
    with torch.device("meta"):
        meta_model: Any = Qwen3ForCausalLM(config)
    generator = torch.Generator().manual_seed(shape.seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, param in sorted(meta_model.named_parameters()):
        if shape.tie_word_embeddings and name == "lm_head.weight":
            continue
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(param.shape, dtype=torch.float32)
        else:
            tensor = torch.empty(param.shape, dtype=torch.float32)
            tensors[name] = tensor.normal_(0.0, shape.init_std, generator=generator)
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    config.architectures = [shape.architecture]
    config.save_pretrained(partial)
    save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    shutil.rmtree(path, ignore_errors=True)
    partial.rename(path)


def _spec_matches(path: Path, spec: dict[str, Any]) -> bool:
    marker = path / SPEC_FILE
    if not marker.is_file() or not (path / "model.safetensors").is_file():
        return False
    try:
        return bool(json.loads(marker.read_text(encoding="utf-8")) == spec)
    except (OSError, json.JSONDecodeError):
        return False


def _write_spec(path: Path, spec: dict[str, Any]) -> None:
    (path / SPEC_FILE).write_text(json.dumps(spec, sort_keys=True) + "\n", encoding="utf-8")


#: The tiny checkpoint of the device workload's CPU plumbing run (``--quick``).
TINY_DEVICE = TinySpec(seed=0)


def tiny_checkpoint(cache_dir: Path) -> Checkpoint:
    """A tiny random Qwen3 (:data:`TINY_DEVICE`), built once into ``cache_dir``."""
    path = cache_dir / "device-tiny"
    spec = asdict(TINY_DEVICE)
    if not _spec_matches(path, spec):
        shutil.rmtree(path, ignore_errors=True)
        build_tiny_checkpoint(TINY_DEVICE, path)
        _write_spec(path, spec)
    return Checkpoint(path, "device-tiny", "a tiny random Qwen3 for the CPU plumbing run")
