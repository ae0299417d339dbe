"""The model configuration: the fields of a Hugging Face Qwen3 ``config.json`` pagedkv uses.

:meth:`ModelConfig.from_dict` validates everything it reads. A field pagedkv needs but the
file lacks raises :class:`~pagedkv.errors.CheckpointError` naming the field; an option pagedkv
does not implement (another architecture, RoPE scaling, sliding-window attention, an activation
other than SiLU) raises :class:`~pagedkv.errors.UnsupportedModel` naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pagedkv.errors import CheckpointError, UnsupportedModel

#: The architecture and model type pagedkv implements.
SUPPORTED_ARCHITECTURE = "Qwen3ForCausalLM"
SUPPORTED_MODEL_TYPE = "qwen3"

#: Defaults taken when an optional field is absent (those of transformers' ``Qwen3Config``).
DEFAULT_MAX_POSITION_EMBEDDINGS = 32768


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
        rope_theta: RoPE base frequency.
        max_position_embeddings: positions the model was trained for.
        tie_word_embeddings: whether the LM head reuses the embedding table.
        attention_bias: whether the q/k/v/o projections carry a bias.
        eos_token_id: end-of-sequence ids, possibly empty.
        bos_token_id: beginning-of-sequence id, if any.
        dtype: the dtype name the checkpoint declares (``dtype`` or ``torch_dtype``), if any.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int = DEFAULT_MAX_POSITION_EMBEDDINGS
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    eos_token_id: tuple[int, ...] = ()
    bos_token_id: int | None = None
    dtype: str | None = None

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
        _check_supported(raw)
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
        return cls(
            vocab_size=_positive_int(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_positive_int(raw, "intermediate_size"),
            num_hidden_layers=_positive_int(raw, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_positive_float("rms_norm_eps", raw.get("rms_norm_eps")),
            rope_theta=_rope_theta(raw),
            max_position_embeddings=(
                DEFAULT_MAX_POSITION_EMBEDDINGS
                if raw.get("max_position_embeddings") is None
                else _positive_int(raw, "max_position_embeddings")
            ),
            tie_word_embeddings=_bool(raw, "tie_word_embeddings", default=False),
            attention_bias=_bool(raw, "attention_bias", default=False),
            eos_token_id=_token_ids(raw, "eos_token_id"),
            bos_token_id=_optional_token_id(raw, "bos_token_id"),
            dtype=_dtype_name(raw),
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


def _check_supported(raw: Mapping[str, object]) -> None:
    if "model_type" not in raw:
        raise CheckpointError("config field 'model_type' is missing")
    if raw["model_type"] != SUPPORTED_MODEL_TYPE:
        raise UnsupportedModel(
            f"config field 'model_type' is {raw['model_type']!r}; only "
            f"{SUPPORTED_MODEL_TYPE!r} is supported"
        )
    architectures = raw.get("architectures")
    if architectures is not None and (
        not isinstance(architectures, list)
        or any(a != SUPPORTED_ARCHITECTURE for a in architectures)
    ):
        raise UnsupportedModel(
            f"config field 'architectures' is {architectures!r}; only "
            f"[{SUPPORTED_ARCHITECTURE!r}] is supported"
        )
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
    scaling = raw.get("rope_scaling")
    if scaling is not None and _rope_type(scaling) != "default":
        raise UnsupportedModel(
            f"config field 'rope_scaling' is {scaling!r}; only default RoPE is supported"
        )


def _rope_type(params: object) -> object:
    if not isinstance(params, dict):
        return params
    return params.get("rope_type", params.get("type", "default"))


def _rope_theta(raw: Mapping[str, object]) -> float:
    """``rope_parameters.rope_theta`` (transformers 5) or the legacy top-level ``rope_theta``."""
    params = raw.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise CheckpointError(f"config field 'rope_parameters' is not an object: {params!r}")
        rope_type = _rope_type(params)
        if rope_type != "default":
            raise UnsupportedModel(
                f"config field 'rope_parameters.rope_type' is {rope_type!r}; only 'default' "
                "is supported"
            )
        if params.get("rope_theta") is not None:
            return _positive_float("rope_parameters.rope_theta", params["rope_theta"])
    if raw.get("rope_theta") is None:
        raise CheckpointError(
            "config field 'rope_theta' (or 'rope_parameters.rope_theta') is missing"
        )
    return _positive_float("rope_theta", raw["rope_theta"])


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
