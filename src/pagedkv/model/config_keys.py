"""Every top-level ``config.json`` key pagedkv knows, per model type, and the check that refuses
the rest.

A key is *used* (read by :class:`~pagedkv.model.config.ModelConfig`), *inert* (it has no effect
on inference, for the reason given), or unknown: an unknown key is refused with
:class:`~pagedkv.errors.UnsupportedModel` naming it, so nothing a checkpoint asks for is ignored
silently (``quantization_config``, a new attention variant, ...). Keys starting with ``_``
(``_name_or_path``) are bookkeeping of the tool that wrote the file and are inert. torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping

from pagedkv.errors import UnsupportedModel

#: Keys read for every Qwen3 model type.
USED_KEYS = frozenset(
    {
        "architectures",
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "rms_norm_eps",
        "max_position_embeddings",
        "rope_theta",
        "rope_parameters",
        "rope_scaling",
        "original_max_position_embeddings",
        "partial_rotary_factor",
        "tie_word_embeddings",
        "attention_bias",
        "use_sliding_window",
        "layer_types",
        "eos_token_id",
        "bos_token_id",
        "dtype",
        "torch_dtype",
    }
)

#: Keys read only for ``qwen3_moe`` (``num_local_experts`` is what transformers 5 writes for
#: ``num_experts``).
MOE_KEYS = frozenset(
    {
        "num_experts",
        "num_local_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
    }
)

#: Keys with no effect on inference, and why.
INERT_KEYS: dict[str, str] = {
    "attention_dropout": "dropout is off at inference",
    "initializer_range": "weights come from the checkpoint",
    "use_cache": "pagedkv always caches K/V in its page pool (v1) or recomputes (v0)",
    "pad_token_id": "pagedkv never pads a sequence",
    "sliding_window": "read only with use_sliding_window, which is refused",
    "max_window_layers": "read only with use_sliding_window, which is refused",
    "transformers_version": "provenance",
    "output_hidden_states": "a transformers output switch",
    "output_attentions": "a transformers output switch",
    "return_dict": "a transformers output switch",
    "chunk_size_feed_forward": "a memory/speed switch of transformers, same results",
    "problem_type": "used by classification heads only",
    "id2label": "used by classification heads only",
    "label2id": "used by classification heads only",
    "tokenizer_class": "the tokenizer is read from its own files",
    "is_encoder_decoder": "false for Qwen3 (true is refused)",
}

#: Keys inert for ``qwen3_moe`` only: both shape the training loss.
MOE_INERT_KEYS: dict[str, str] = {
    "output_router_logits": "the router's auxiliary loss is a training term",
    "router_aux_loss_coef": "the router's auxiliary loss is a training term",
}


def check_known_keys(raw: Mapping[str, object], moe: bool) -> None:
    """Refuse any top-level key that is neither used nor inert for the model type.

    Raises:
        UnsupportedModel: naming the first unknown key (alphabetically).
    """
    if raw.get("is_encoder_decoder"):
        raise UnsupportedModel("config field 'is_encoder_decoder' is true; Qwen3 is decoder-only")
    known = USED_KEYS | INERT_KEYS.keys()
    if moe:
        known |= MOE_KEYS | MOE_INERT_KEYS.keys()
    for key in sorted(raw):
        if key not in known and not key.startswith("_"):
            kind = "qwen3_moe" if moe else "qwen3"
            raise UnsupportedModel(
                f"config field {key!r} is not one pagedkv implements for model_type {kind!r}; "
                "it is refused rather than ignored"
            )
