"""Deterministic tiny Qwen3 checkpoints for tests, the conformance suite and benchmarks.

A checkpoint is built with transformers' own ``Qwen3ForCausalLM`` or ``Qwen3MoeForCausalLM``
(so it is a genuine Hugging Face checkpoint, written by ``save_pretrained``), its parameters then
overwritten from a seeded local generator:

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
  norm or bias is caught;
* MoE experts like the dense MLP (``gate_up_proj`` ``N(0, 1/hidden)``, ``down_proj`` with the
  residual gain), the router ``N(0, (ROUTER_GAIN**2)/hidden)``: router logits of a few units,
  so the top-k choice is far from ties (:func:`min_router_margin` measures it) and the
  routing weights differ visibly between experts.

:data:`PRESETS` are dense Qwen3 with default RoPE; :data:`FAMILY_PRESETS` cover the rest of the
family: Qwen3-MoE (all-sparse and mixed dense/sparse layers) and scaled RoPE (YaRN, linear,
Llama-3, proportional), each used past its ``original_max_position_embeddings``.

Nothing here touches the global RNG (the Hugging Face init runs inside ``fork_rng``) or the
network. transformers is imported lazily, inside the functions that need it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedkv.device import DEFAULT_DEVICE
from pagedkv.errors import InvalidRequest

#: Environment variable naming the device tests run the model on.
DEVICE_ENV = "PAGEDKV_DEVICE"

#: Gain of the init of the projections writing into the residual stream (see module doc).
RESIDUAL_GAIN = 8.0
#: Gain of the init of the MoE router (see module doc).
ROUTER_GAIN = 3.0

#: A value of ``rope_parameters``.
RopeValue = float | int | bool | str


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
        experts: experts per sparse layer; 0 builds a dense Qwen3, more a Qwen3-MoE.
        experts_per_tok: top-k of the router.
        moe_intermediate: width of each expert's hidden layer.
        norm_topk_prob: whether the top-k routing weights are renormalised.
        decoder_sparse_step: every this many layers is sparse.
        mlp_only_layers: layers forced dense.
        rope_scaling: RoPE parameters besides ``rope_theta`` (``rope_type``, ``factor``, ...),
            as ``(key, value)`` pairs; empty for default RoPE.
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
    experts: int = 0
    experts_per_tok: int = 2
    moe_intermediate: int = 32
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rope_scaling: tuple[tuple[str, RopeValue], ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def rope_parameters(self) -> dict[str, RopeValue]:
        """The config's ``rope_parameters``."""
        return {"rope_type": "default", "rope_theta": self.rope_theta, **dict(self.rope_scaling)}


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


#: The rest of the Qwen3 family. Prompts reach position 62 in the golden suite, past every
#: ``original_max_position_embeddings`` here (32 or 24).
FAMILY_PRESETS: dict[str, TinySpec] = {
    # MoE, every layer sparse, top-2 of 8 renormalised
    "moe-top2-norm": TinySpec(experts=8, experts_per_tok=2, norm_topk_prob=True, seed=37),
    # MoE mixing dense and sparse layers: step 2 makes layers 1 and 3 sparse, mlp_only_layers
    # forces 3 dense again; top-3 of 6 not renormalised; tied, one KV head, head_dim 24
    "moe-mixed-dense": TinySpec(
        tie_word_embeddings=True,
        heads=4,
        kv_heads=1,
        head_dim=24,
        layers=4,
        experts=6,
        experts_per_tok=3,
        moe_intermediate=24,
        decoder_sparse_step=2,
        mlp_only_layers=(3,),
        seed=21,
    ),
    # YaRN x4 from 32 positions, serving 128: Qwen3's documented long-context setting scaled
    # down (its config declares max_position_embeddings 40960, YaRN 4 x 32768 serves 131072)
    "yarn": TinySpec(
        rope_scaling=(
            ("rope_type", "yarn"),
            ("factor", 4.0),
            ("original_max_position_embeddings", 32),
        ),
        max_position_embeddings=40,
        seed=13,
    ),
    # MoE with YaRN: explicit beta, mscale terms and an untruncated ramp
    "moe-yarn-mscale": TinySpec(
        experts=4,
        experts_per_tok=2,
        rope_scaling=(
            ("rope_type", "yarn"),
            ("factor", 8.0),
            ("original_max_position_embeddings", 24),
            ("beta_fast", 16.0),
            ("beta_slow", 2.0),
            ("mscale", 1.0),
            ("mscale_all_dim", 0.5),
            ("truncate", False),
        ),
        max_position_embeddings=192,
        seed=31,
    ),
    # linear position interpolation x2
    "linear": TinySpec(
        rope_scaling=(("rope_type", "linear"), ("factor", 2.0)),
        max_position_embeddings=64,
        seed=15,
    ),
    # Llama 3.1 frequency blending (theta 500000 puts wavelengths on both sides of the bounds)
    "llama3": TinySpec(
        rope_theta=500000.0,
        rope_scaling=(
            ("rope_type", "llama3"),
            ("factor", 8.0),
            ("original_max_position_embeddings", 32),
            ("low_freq_factor", 1.0),
            ("high_freq_factor", 4.0),
        ),
        max_position_embeddings=256,
        seed=16,
    ),
    # proportional RoPE rotating half of each head's channel pairs
    "proportional": TinySpec(
        rope_scaling=(
            ("rope_type", "proportional"),
            ("factor", 2.0),
            ("partial_rotary_factor", 0.5),
        ),
        seed=17,
    ),
}


#: Shapes for tensor parallelism (specs/tensor-parallel.md) that the presets above lack.
TP_PRESETS: dict[str, TinySpec] = {
    # untied, six query heads and ONE K/V head, biases: at 2 and 3 ranks every rank holds a
    # replica of the K/V head; a vocabulary (253) that neither 2 nor 3 divides pads the last
    # rank's block; the MLP width (192) splits over 2 and 3
    "tp3-kv1": TinySpec(
        vocab=253,
        heads=6,
        kv_heads=1,
        head_dim=16,
        intermediate=192,
        attention_bias=True,
        seed=41,
    ),
}


def preset_spec(name: str) -> TinySpec:
    """The spec of a preset of :data:`PRESETS`, :data:`FAMILY_PRESETS` or
    :data:`TP_PRESETS`.

    Raises:
        InvalidRequest: no preset has that name.
    """
    spec = PRESETS.get(name) or FAMILY_PRESETS.get(name) or TP_PRESETS.get(name)
    if spec is None:
        raise InvalidRequest(f"no tiny preset named {name!r}")
    return spec


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run the body with ``count`` intra-op torch threads, restoring the previous count after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def one_torch_thread() -> AbstractContextManager[None]:
    """Run the body with one intra-op torch thread, restoring the previous count after.

    Tiny models gain nothing from threads, and on a loaded machine the thread pool's
    contention can make them many times slower. Opt-in, for tests and benchmarks only.
    """
    return torch_threads(1)


def model_device() -> str:
    """The device tests run the model on: ``$PAGEDKV_DEVICE``, default ``cpu``."""
    return os.environ.get(DEVICE_ENV, "cpu")


def hf_config(spec: TinySpec) -> Any:
    """transformers' ``Qwen3Config`` (or ``Qwen3MoeConfig``) for ``spec`` (SiLU, no sliding
    window)."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    common: dict[str, Any] = dict(
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
        rope_parameters=spec.rope_parameters,
        attention_bias=spec.attention_bias,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=spec.eos_token_id,
        pad_token_id=None,
    )
    if not spec.is_moe:
        return Qwen3Config(**common)
    return Qwen3MoeConfig(
        **common,
        num_experts=spec.experts,
        num_experts_per_tok=spec.experts_per_tok,
        moe_intermediate_size=spec.moe_intermediate,
        norm_topk_prob=spec.norm_topk_prob,
        decoder_sparse_step=spec.decoder_sparse_step,
        mlp_only_layers=list(spec.mlp_only_layers),
    )


def _init_std(name: str, shape: torch.Size) -> tuple[float, float]:
    """``(mean, std)`` of the init of parameter ``name``."""
    if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
        return 0.0, 1.0
    if name.endswith("norm.weight"):
        return 1.0, 0.2
    if name.endswith(".bias"):
        return 0.0, 0.1
    if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
        return 0.0, RESIDUAL_GAIN / math.sqrt(shape[-1])
    if name.endswith("mlp.gate.weight"):
        return 0.0, ROUTER_GAIN / math.sqrt(shape[-1])
    return 0.0, 1.0 / math.sqrt(shape[-1])


def build_hf_model(spec: TinySpec) -> Any:
    """A transformers ``Qwen3ForCausalLM`` (``Qwen3MoeForCausalLM`` with experts) in float32
    with the seeded init of ``spec``."""
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

    if spec.heads % spec.kv_heads != 0 or spec.head_dim % 2 != 0:
        raise InvalidRequest(f"invalid tiny spec {spec}")
    model_class: Any = Qwen3MoeForCausalLM if spec.is_moe else Qwen3ForCausalLM
    with torch.random.fork_rng(devices=[]):
        model: Any = model_class(hf_config(spec))
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


def load_hf_reference(
    model_dir: str | Path, dtype: str = "float32", device: str = DEFAULT_DEVICE
) -> Any:
    """The checkpoint loaded by transformers (eager attention, eval mode), the golden reference.

    Eager attention is the reference because it is transformers' plain softmax(QK^T)V with
    an explicit causal mask, independent of which fused kernels the platform offers; a MoE
    model's experts likewise run transformers' eager loop over experts.
    """
    from transformers import AutoModelForCausalLM

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    options: dict[str, Any] = {"dtype": dtypes[dtype], "attn_implementation": "eager"}
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    if config.get("model_type") == "qwen3_moe":
        options["experts_implementation"] = "eager"
    auto_model: Any = AutoModelForCausalLM
    model = auto_model.from_pretrained(str(model_dir), local_files_only=True, **options)
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


def min_router_margin(hf_model: Any, prompts: Sequence[Sequence[int]]) -> float:
    """Smallest gap between the k-th and (k+1)-th router logit, over every token of
    ``prompts`` and every sparse layer of a transformers Qwen3-MoE ``hf_model``.

    A margin far above the numeric error between two implementations means they route every
    token to the same experts; ``inf`` when top-k takes every expert.
    """
    top_k = int(hf_model.config.num_experts_per_tok)
    device = next(hf_model.parameters()).device
    margin = math.inf
    for prompt in prompts:
        ids = torch.tensor([list(prompt)], dtype=torch.int64, device=device)
        with torch.no_grad():
            out = hf_model(input_ids=ids, use_cache=False, output_router_logits=True)
        for logits in out.router_logits:
            ranked = torch.sort(logits.float(), dim=-1, descending=True).values
            if ranked.shape[-1] > top_k:
                margin = min(margin, float((ranked[:, top_k - 1] - ranked[:, top_k]).min()))
    return margin
