"""The model configuration: the fields of a Hugging Face Qwen3 or Qwen3-MoE ``config.json``.

:meth:`ModelConfig.from_dict` validates everything it reads. A field pagedkv needs but the
file lacks raises :class:`~pagedkv.errors.CheckpointError` naming the field; an option pagedkv
does not implement (another architecture, a length-dependent RoPE type, sliding-window
attention, an activation other than SiLU, a key it does not know) raises
:class:`~pagedkv.errors.UnsupportedModel` naming the field. The RoPE variant is read by
:mod:`pagedkv.model.rope_config`, the known keys are listed in :mod:`pagedkv.model.config_keys`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pagedkv.errors import CheckpointError, UnsupportedModel
from pagedkv.model.config_keys import check_known_keys
from pagedkv.model.rope_config import RopeConfig, parse_rope

#: The model types pagedkv implements and the one architecture each declares.
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}

#: Defaults taken when an optional field is absent (those of transformers' ``Qwen3Config``).
DEFAULT_MAX_POSITION_EMBEDDINGS = 32768


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """The sparse mixture-of-experts MLP of Qwen3-MoE (``model_type: qwen3_moe``).

    Attributes:
        num_experts: experts per sparse layer.
        num_experts_per_tok: experts each token is routed to (top-k), <= ``num_experts``.
        moe_intermediate_size: width of each expert's SwiGLU hidden layer.
        norm_topk_prob: whether the top-k routing probabilities are renormalised to sum to 1.
        decoder_sparse_step: layer ``i`` is sparse when ``(i + 1) % decoder_sparse_step == 0``
            and ``i`` is not in ``mlp_only_layers``; the others use the dense MLP of width
            ``intermediate_size``.
        mlp_only_layers: layers forced dense.
    """

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` uses the sparse MoE block (transformers' rule)."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a Qwen3 decoder-only model.

    Attributes:
        vocab_size: rows of the embedding table and of the LM head.
        hidden_size: width of the residual stream.
        intermediate_size: width of the SwiGLU MLP's hidden layer.
        num_hidden_layers: decoder layers.
        num_attention_heads: query heads per layer.
        num_key_value_heads: key/value heads per layer; divides ``num_attention_heads``.
        head_dim: channels per head (need not equal ``hidden_size / num_attention_heads``).
        rms_norm_eps: epsilon added to the mean square in every RMSNorm.
        rope: the RoPE variant and its parameters (base frequency, scaling).
        max_position_embeddings: the config's ``max_position_embeddings``; see
            :attr:`max_positions` for the context the model serves.
        tie_word_embeddings: whether the LM head reuses the embedding table.
        attention_bias: whether the q/k/v/o projections carry a bias.
        eos_token_id: end-of-sequence ids, possibly empty.
        bos_token_id: beginning-of-sequence id, if any.
        dtype: the dtype name the checkpoint declares (``dtype`` or ``torch_dtype``), if any.
        moe: the sparse MLP of a Qwen3-MoE model, ``None`` for dense Qwen3.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int = DEFAULT_MAX_POSITION_EMBEDDINGS
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    eos_token_id: tuple[int, ...] = ()
    bos_token_id: int | None = None
    dtype: str | None = None
    moe: MoeConfig | None = None

    @property
    def rope_theta(self) -> float:
        """RoPE base frequency."""
        return self.rope.theta

    @property
    def max_positions(self) -> int:
        """Positions the model serves: ``max_position_embeddings``, scaled by the RoPE type
        (YaRN: ``original_max_position_embeddings * factor``; linear: ``* factor``)."""
        return self.rope.context_length(self.max_position_embeddings)

    @property
    def model_type(self) -> str:
        """``qwen3_moe`` when the model has sparse layers' config, else ``qwen3``."""
        return "qwen3" if self.moe is None else "qwen3_moe"

    @property
    def num_kv_groups(self) -> int:
        """Query heads sharing one key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_size(self) -> int:
        """Output width of ``q_proj``: ``num_attention_heads * head_dim``."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Output width of ``k_proj`` and ``v_proj``: ``num_key_value_heads * head_dim``."""
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, raw: Mapping[str, object]) -> ModelConfig:
        """Parse and validate a ``config.json`` mapping.

        Raises:
            UnsupportedModel: the architecture or an option is not implemented.
            CheckpointError: a required field is missing or has the wrong type or range.
        """
        moe = _check_supported(raw)
        heads = _positive_int(raw, "num_attention_heads")
        hidden = _positive_int(raw, "hidden_size")
        kv_heads = (
            heads
            if raw.get("num_key_value_heads") is None
            else _positive_int(raw, "num_key_value_heads")
        )
        if heads % kv_heads != 0:
            raise CheckpointError(
                f"num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}"
            )
        if raw.get("head_dim") is None:
            if hidden % heads != 0:
                raise CheckpointError(
                    f"head_dim is absent and hidden_size={hidden} is not a multiple of "
                    f"num_attention_heads={heads}"
                )
            head_dim = hidden // heads
        else:
            head_dim = _positive_int(raw, "head_dim")
        if head_dim % 2 != 0:
            raise CheckpointError(f"head_dim must be even for RoPE, got {head_dim}")
        max_positions = (
            DEFAULT_MAX_POSITION_EMBEDDINGS
            if raw.get("max_position_embeddings") is None
            else _positive_int(raw, "max_position_embeddings")
        )
        layers = _positive_int(raw, "num_hidden_layers")
        return cls(
            vocab_size=_positive_int(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_positive_int(raw, "intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_positive_float("rms_norm_eps", raw.get("rms_norm_eps")),
            rope=parse_rope(raw, max_positions),
            max_position_embeddings=max_positions,
            tie_word_embeddings=_bool(raw, "tie_word_embeddings", default=False),
            attention_bias=_bool(raw, "attention_bias", default=False),
            eos_token_id=_token_ids(raw, "eos_token_id"),
            bos_token_id=_optional_token_id(raw, "bos_token_id"),
            dtype=_dtype_name(raw),
            moe=_moe(raw, layers) if moe else None,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read ``model_dir/config.json``.

        Raises:
            CheckpointError: the directory or file is missing or not a JSON object (the message
                names the path), or a field is missing or invalid.
            UnsupportedModel: see :meth:`from_dict`.
        """
        directory = Path(model_dir)
        if not directory.is_dir():
            raise CheckpointError(f"model directory {directory} does not exist")
        path = directory / "config.json"
        if not path.is_file():
            raise CheckpointError(f"model config {path} does not exist")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"cannot read model config {path}: {exc}") from exc
        if not isinstance(raw, dict):
            raise CheckpointError(f"model config {path} is not a JSON object")
        return cls.from_dict(raw)


def _check_supported(raw: Mapping[str, object]) -> bool:
    """Refuse what pagedkv does not implement; whether the model is a Qwen3-MoE."""
    if "model_type" not in raw:
        raise CheckpointError("config field 'model_type' is missing")
    model_type = raw["model_type"]
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
        raise UnsupportedModel(
            f"config field 'model_type' is {model_type!r}; supported: "
            f"{', '.join(repr(t) for t in ARCHITECTURES)}"
        )
    architecture = ARCHITECTURES[model_type]
    architectures = raw.get("architectures")
    if architectures is not None and (
        not isinstance(architectures, list) or any(a != architecture for a in architectures)
    ):
        raise UnsupportedModel(
            f"config field 'architectures' is {architectures!r}; model_type {model_type!r} "
            f"supports only [{architecture!r}]"
        )
    moe = model_type == "qwen3_moe"
    check_known_keys(raw, moe)
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(f"config field 'hidden_act' is {act!r}; only 'silu' is supported")
    if raw.get("use_sliding_window"):
        raise UnsupportedModel("config field 'use_sliding_window' is true; it is not supported")
    layer_types = raw.get("layer_types")
    if layer_types is not None and (
        not isinstance(layer_types, list) or any(t != "full_attention" for t in layer_types)
    ):
        raise UnsupportedModel(
            "config field 'layer_types' asks for layers other than 'full_attention'"
        )
    return moe


def _moe(raw: Mapping[str, object], layers: int) -> MoeConfig:
    """The MoE fields of a ``qwen3_moe`` config (defaults: transformers' ``Qwen3MoeConfig``)."""
    experts = _num_experts(raw)
    top_k = _positive_int(raw, "num_experts_per_tok")
    if top_k > experts:
        raise CheckpointError(
            f"config field 'num_experts_per_tok' ({top_k}) exceeds num_experts ({experts})"
        )
    step = (
        1 if raw.get("decoder_sparse_step") is None else _positive_int(raw, "decoder_sparse_step")
    )
    dense = raw.get("mlp_only_layers")
    if dense is None:
        dense = []
    if not isinstance(dense, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in dense
    ):
        raise CheckpointError(
            f"config field 'mlp_only_layers' must list layer indices in [0, {layers}), "
            f"got {dense!r}"
        )
    return MoeConfig(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=_positive_int(raw, "moe_intermediate_size"),
        norm_topk_prob=_bool(raw, "norm_topk_prob", default=False),
        decoder_sparse_step=step,
        mlp_only_layers=tuple(sorted(set(dense))),
    )


def _num_experts(raw: Mapping[str, object]) -> int:
    """``num_experts`` (released checkpoints) or ``num_local_experts`` (what transformers 5
    writes); both present must agree."""
    names = [n for n in ("num_experts", "num_local_experts") if raw.get(n) is not None]
    if not names:
        raise CheckpointError("config field 'num_experts' (or 'num_local_experts') is missing")
    values = {_positive_int(raw, n) for n in names}
    if len(values) > 1:
        raise CheckpointError(
            f"config fields 'num_experts' ({raw['num_experts']}) and 'num_local_experts' "
            f"({raw['num_local_experts']}) disagree"
        )
    return values.pop()


def _positive_int(raw: Mapping[str, object], name: str) -> int:
    if raw.get(name) is None:
        raise CheckpointError(f"config field {name!r} is missing")
    value = raw[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CheckpointError(f"config field {name!r} must be a positive integer, got {value!r}")
    return value


def _positive_float(name: str, value: object) -> float:
    if value is None:
        raise CheckpointError(f"config field {name!r} is missing")
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise CheckpointError(f"config field {name!r} must be a positive number, got {value!r}")
    return float(value)


def _bool(raw: Mapping[str, object], name: str, *, default: bool) -> bool:
    value = raw.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise CheckpointError(f"config field {name!r} must be true or false, got {value!r}")
    return value


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _optional_token_id(raw: Mapping[str, object], name: str) -> int | None:
    value = raw.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or not _is_token_id(value):
        raise CheckpointError(f"config field {name!r} must be a token id, got {value!r}")
    return value


def _token_ids(raw: Mapping[str, object], name: str) -> tuple[int, ...]:
    value = raw.get(name)
    if value is None:
        return ()
    if isinstance(value, int) and _is_token_id(value):
        return (value,)
    if isinstance(value, list) and all(_is_token_id(v) for v in value):
        return tuple(int(v) for v in value)
    raise CheckpointError(f"config field {name!r} must be a token id or a list of them")


def _dtype_name(raw: Mapping[str, object]) -> str | None:
    for name in ("dtype", "torch_dtype"):
        value = raw.get(name)
        if value is not None:
            if not isinstance(value, str):
                raise CheckpointError(f"config field {name!r} must be a string, got {value!r}")
            return value
    return None
