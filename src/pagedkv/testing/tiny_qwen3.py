"""Deterministic tiny Qwen3 checkpoints for tests, the conformance suite and benchmarks.

A checkpoint is built with transformers' own ``Qwen3ForCausalLM`` (so it is a genuine Hugging
Face checkpoint), its parameters then overwritten from a seeded local generator:

* embeddings ``N(0, 1)``, the untied LM head ``N(0, 1)``: with an RMS-normalised final hidden
  state of unit scale, logits have a standard deviation near ``sqrt(hidden)`` (8 for hidden
  64, against float32 errors near ``1e-5``), so greedy top-1 / top-2 gaps are typically tens of
  thousands of times the numeric error. Gaps of random logits can still be small by chance:
  :func:`min_top2_margin` measures them for a given set of prompts, so a token-exact check can
  assert its margin first;
* q/k/v and the MLP's gate/up projections ``N(0, 1/fan_in)`` (unit-scale outputs); the
  projections that write into the residual stream (``o_proj``, ``down_proj``)
  ``N(0, (RESIDUAL_GAIN**2)/fan_in)``, so the layers' contributions outweigh the token's own
  embedding: attention visibly shapes the logits, and a tied model does not simply predict its
  input token again (its logits are ``norm(h) . E`` and ``h`` would otherwise be mostly ``E[t]``);
* norm weights ``1 + N(0, 0.2**2)``, biases ``N(0, 0.1**2)``, so a loader that swaps or skips a
  norm or bias is caught.

Nothing here touches the global RNG (the Hugging Face init runs inside ``fork_rng``) or the
network. transformers is imported lazily, inside the functions that need it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedkv.errors import InvalidRequest

#: Environment variable naming the device tests run the model on.
DEVICE_ENV = "PAGEDKV_DEVICE"

#: Gain of the init of the projections writing into the residual stream (see module doc).
RESIDUAL_GAIN = 8.0


@dataclass(frozen=True, slots=True)
class TinySpec:
    """Shape and seed of a tiny Qwen3 checkpoint.

    Attributes:
        vocab: vocabulary size.
        hidden: residual width.
        layers: decoder layers.
        heads: query heads.
        kv_heads: key/value heads; divides ``heads``.
        head_dim: channels per head, even; may differ from ``hidden / heads``.
        intermediate: MLP width.
        tie_word_embeddings: whether the LM head is the embedding table.
        rope_theta: RoPE base.
        seed: seed of the parameter init.
        max_position_embeddings: positions the config declares.
        attention_bias: whether q/k/v/o projections have biases.
        rms_norm_eps: RMSNorm epsilon.
        eos_token_id: the config's end-of-sequence id, or ``None`` for none.
    """

    vocab: int = 256
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 128
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    seed: int = 0
    max_position_embeddings: int = 512
    attention_bias: bool = False
    rms_norm_eps: float = 1e-6
    eos_token_id: int | None = None


#: Named presets covering tied/untied heads, GQA 1:1, 2:1 and 4:1, and ``head_dim`` both equal
#: to and different from ``hidden / heads``.
PRESETS: dict[str, TinySpec] = {
    # tied, GQA 2:1, head_dim == hidden / heads
    "tied-gqa2": TinySpec(tie_word_embeddings=True, heads=4, kv_heads=2, head_dim=16, seed=1),
    # untied, MHA (1:1), head_dim == hidden / heads
    "untied-mha": TinySpec(tie_word_embeddings=False, heads=4, kv_heads=4, head_dim=16, seed=2),
    # untied, GQA 4:1, head_dim (32) != hidden / heads (8), three layers
    "untied-gqa4-wide": TinySpec(
        tie_word_embeddings=False, heads=8, kv_heads=2, head_dim=32, layers=3, seed=3
    ),
    # tied, GQA 4:1 with a single KV head, head_dim (24) != hidden / heads (16), biases
    "tied-gqa4-bias": TinySpec(
        tie_word_embeddings=True, heads=4, kv_heads=1, head_dim=24, attention_bias=True, seed=4
    ),
}


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run the body with one intra-op torch thread, restoring the previous count after.

    Tiny models gain nothing from threads, and on a loaded machine the thread pool's
    contention can make them many times slower. Opt-in, for tests and benchmarks only.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def model_device() -> str:
    """The device tests run the model on: ``$PAGEDKV_DEVICE``, default ``cpu``."""
    return os.environ.get(DEVICE_ENV, "cpu")


def hf_config(spec: TinySpec) -> Any:
    """transformers' ``Qwen3Config`` for ``spec`` (default RoPE, SiLU, no sliding window)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        hidden_act="silu",
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        tie_word_embeddings=spec.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        attention_bias=spec.attention_bias,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=spec.eos_token_id,
        pad_token_id=None,
    )


def _init_std(name: str, shape: torch.Size) -> tuple[float, float]:
    """``(mean, std)`` of the init of parameter ``name``."""
    if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
        return 0.0, 1.0
    if name.endswith("norm.weight"):
        return 1.0, 0.2
    if name.endswith(".bias"):
        return 0.0, 0.1
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 0.0, RESIDUAL_GAIN / math.sqrt(shape[-1])
    return 0.0, 1.0 / math.sqrt(shape[-1])


def build_hf_model(spec: TinySpec) -> Any:
    """A transformers ``Qwen3ForCausalLM`` in float32 with the seeded init of ``spec``."""
    from transformers import Qwen3ForCausalLM

    if spec.heads % spec.kv_heads != 0 or spec.head_dim % 2 != 0:
        raise InvalidRequest(f"invalid tiny spec {spec}")
    with torch.random.fork_rng(devices=[]):
        model: Any = Qwen3ForCausalLM(hf_config(spec))
    generator = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            mean, std = _init_std(name, param.shape)
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            param.copy_(noise * std + mean)
    return model.eval()


def build_tiny_checkpoint(spec: TinySpec, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write the checkpoint of ``spec`` to ``out_dir`` (``config.json`` + ``model.safetensors``).

    Args:
        spec: shape and seed.
        out_dir: created if needed.
        dtype: dtype the weights are stored in: ``float32``, ``bfloat16`` or ``float16``.

    Returns:
        ``out_dir`` as a Path. The same spec always yields the same tensors.
    """
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise InvalidRequest(f"unsupported dtype {dtype!r}")
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    model = build_hf_model(spec).to(dtypes[dtype])
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_hf_reference(model_dir: str | Path, dtype: str = "float32", device: str = "cpu") -> Any:
    """The checkpoint loaded by transformers (eager attention, eval mode), the golden reference.

    Eager attention is the reference because it is transformers' plain softmax(QK^T)V with
    an explicit causal mask, independent of which fused kernels the platform offers.
    """
    from transformers import Qwen3ForCausalLM

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    model_class: Any = Qwen3ForCausalLM
    model = model_class.from_pretrained(
        str(model_dir), dtype=dtypes[dtype], attn_implementation="eager"
    )
    return model.to(device).eval()


def reference_logits(hf_model: Any, token_ids: Sequence[int]) -> torch.Tensor:
    """``[len(token_ids), vocab]`` float32 logits of every position, by transformers."""
    device = next(hf_model.parameters()).device
    ids = torch.tensor([list(token_ids)], dtype=torch.int64, device=device)
    with torch.no_grad():
        logits: torch.Tensor = hf_model(input_ids=ids, use_cache=False).logits[0]
    return logits.to(torch.float32)


def min_top2_margin(hf_model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> float:
    """Smallest top-1 minus top-2 logit gap over greedy runs of ``hf_model`` from ``prompts``.

    Each prompt is extended greedily by ``max_new_tokens`` tokens (full recompute each step);
    the gap is taken at every generated position. A margin far above the numeric error between
    two implementations means their greedy tokens cannot differ by a near-tie.
    """
    if max_new_tokens < 1:
        raise InvalidRequest("max_new_tokens must be >= 1")
    margin = math.inf
    for prompt in prompts:
        tokens = list(prompt)
        for _ in range(max_new_tokens):
            last = reference_logits(hf_model, tokens)[-1]
            top = torch.topk(last, 2).values
            margin = min(margin, float(top[0] - top[1]))
            tokens.append(int(torch.argmax(last)))
    return margin
