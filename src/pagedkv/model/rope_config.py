"""The RoPE variant of a Qwen3 ``config.json``: which rope type, and its parameters.

Read as transformers reads it: ``rope_scaling`` (the legacy field, when set) replaces
``rope_parameters``; ``rope_type`` (or the legacy ``type``) picks the variant, ``"default"`` when
absent; ``rope_theta`` comes from those parameters or, failing that, the top level; a top-level
``original_max_position_embeddings`` or ``partial_rotary_factor`` takes part as transformers'
``standardize_rope_params`` makes it.

Supported: ``default``, ``linear``, ``yarn``, ``llama3`` and ``proportional``, whose frequencies
are fixed. Refused with :class:`~pagedkv.errors.UnsupportedModel`: ``dynamic`` and ``longrope``,
which transformers recomputes from the length of each forward call, so a cached token's K/V
would depend on which step computed it (see specs/golden.md, GLD-031); and any other type. A
parameter the chosen type does not use is refused too, naming it. torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pagedkv.errors import CheckpointError, UnsupportedModel

#: Rope types pagedkv implements.
SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn", "llama3", "proportional")
#: Rope types transformers implements but whose frequencies follow the sequence length.
LENGTH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")

#: Parameters each supported type reads (besides ``rope_type``/``type`` and ``rope_theta``).
_TYPE_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset({"partial_rotary_factor"}),
    "linear": frozenset({"factor", "partial_rotary_factor"}),
    "yarn": frozenset(
        {
            "factor",
            "original_max_position_embeddings",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
            "partial_rotary_factor",
        }
    ),
    "llama3": frozenset(
        {
            "factor",
            "original_max_position_embeddings",
            "low_freq_factor",
            "high_freq_factor",
            "partial_rotary_factor",
        }
    ),
    "proportional": frozenset({"factor", "partial_rotary_factor"}),
}
#: YaRN's defaults (transformers' and the paper's).
YARN_BETA_FAST = 32.0
YARN_BETA_SLOW = 1.0


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """A RoPE variant with fixed frequencies.

    Attributes:
        rope_type: one of :data:`SUPPORTED_ROPE_TYPES`.
        theta: RoPE base, > 0.
        factor: context scaling factor (``linear``, ``yarn``, ``llama3``, ``proportional``);
            1.0 for ``default``.
        original_max_position_embeddings: positions of pre-training (``yarn``, ``llama3``).
        attention_factor: YaRN's explicit cos/sin scale, ``None`` to derive it from ``factor``.
        beta_fast, beta_slow: YaRN's ramp bounds, in rotations.
        mscale, mscale_all_dim: YaRN's DeepSeek-style attention-factor terms, ``None`` if unset.
        truncate: whether YaRN rounds its correction range to whole dimensions.
        low_freq_factor, high_freq_factor: Llama-3 smoothing bounds.
        partial_rotary_factor: fraction of each head's channels rotated; 1.0 except with
            ``proportional``.
    """

    rope_type: str
    theta: float
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float = YARN_BETA_FAST
    beta_slow: float = YARN_BETA_SLOW
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    partial_rotary_factor: float = 1.0

    def context_length(self, max_position_embeddings: int) -> int:
        """Positions the scaled model serves, as vLLM derives ``max_model_len``.

        ``yarn``: ``original_max_position_embeddings * factor``; ``linear``:
        ``max_position_embeddings * factor``; the others: ``max_position_embeddings``
        (Llama-3 configs already declare the extended length there).
        """
        if self.rope_type == "yarn" and self.original_max_position_embeddings is not None:
            return int(self.original_max_position_embeddings * self.factor)
        if self.rope_type == "linear":
            return int(max_position_embeddings * self.factor)
        return max_position_embeddings


def parse_rope(raw: Mapping[str, object], max_position_embeddings: int) -> RopeConfig:
    """The RoPE variant of a ``config.json`` mapping.

    Args:
        raw: the whole config mapping.
        max_position_embeddings: the config's (or its default) value, the fallback of
            ``original_max_position_embeddings`` as in transformers.

    Raises:
        UnsupportedModel: a rope type or parameter pagedkv does not implement; the message
            names the field.
        CheckpointError: a parameter the type needs is missing or out of range.
    """
    field, params = _rope_params(raw)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in LENGTH_DEPENDENT_ROPE_TYPES:
        raise UnsupportedModel(
            f"config field '{field}.rope_type' is {rope_type!r}: its frequencies follow the "
            "length of each forward call, so a cached token's K/V would depend on the step "
            f"that computed it; supported rope types: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if not isinstance(rope_type, str) or rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModel(
            f"config field '{field}.rope_type' is {rope_type!r}; supported rope types: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    params = _with_top_level(raw, params, rope_type, max_position_embeddings)
    used = _TYPE_KEYS[rope_type] | {"rope_type", "type", "rope_theta"}
    for key in sorted(params):
        if key not in used:
            raise UnsupportedModel(
                f"config field '{field}.{key}' is not used by rope_type {rope_type!r}; "
                "pagedkv refuses what it would ignore"
            )
    theta = params.get("rope_theta", raw.get("rope_theta"))
    if theta is None:
        raise CheckpointError(f"config field 'rope_theta' (or '{field}.rope_theta') is missing")
    partial = _number(field, params, "partial_rotary_factor", default=1.0)
    if partial != 1.0 and rope_type != "proportional":
        raise UnsupportedModel(
            f"config field '{field}.partial_rotary_factor' is {partial}; Qwen3 rotates whole "
            "heads except with rope_type 'proportional'"
        )
    if partial > 1.0:
        raise CheckpointError(
            f"config field '{field}.partial_rotary_factor' must be in (0, 1], got {partial}"
        )
    base = _positive(field, "rope_theta", theta)
    if rope_type == "default":
        return RopeConfig(rope_type, base)
    default_factor = 1.0 if rope_type == "proportional" else None
    factor = _number(field, params, "factor", default=default_factor)
    if rope_type in ("linear", "proportional"):
        return RopeConfig(rope_type, base, factor, partial_rotary_factor=partial)
    original = params.get("original_max_position_embeddings")
    if not isinstance(original, int) or isinstance(original, bool) or original < 1:
        raise CheckpointError(
            f"config field '{field}.original_max_position_embeddings' must be a positive "
            f"integer, got {original!r}"
        )
    if rope_type == "llama3":
        low = _number(field, params, "low_freq_factor")
        high = _number(field, params, "high_freq_factor")
        if high <= low:
            raise CheckpointError(
                f"config field '{field}.high_freq_factor' ({high}) must exceed "
                f"low_freq_factor ({low})"
            )
        return RopeConfig(
            rope_type,
            base,
            factor,
            original_max_position_embeddings=original,
            low_freq_factor=low,
            high_freq_factor=high,
        )
    return RopeConfig(
        rope_type,
        base,
        factor,
        original_max_position_embeddings=original,
        attention_factor=_optional_number(field, params, "attention_factor"),
        beta_fast=_number(field, params, "beta_fast", default=YARN_BETA_FAST),
        beta_slow=_number(field, params, "beta_slow", default=YARN_BETA_SLOW),
        mscale=_optional_number(field, params, "mscale"),
        mscale_all_dim=_optional_number(field, params, "mscale_all_dim"),
        truncate=_truncate(field, params),
    )


def _rope_params(raw: Mapping[str, object]) -> tuple[str, dict[str, object]]:
    """``(field name, parameters)``: ``rope_scaling`` when set (it wins, as in transformers),
    else ``rope_parameters``, else empty."""
    for field in ("rope_scaling", "rope_parameters"):
        value = raw.get(field)
        if value is None or value == {}:
            continue
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise CheckpointError(f"config field {field!r} is not an object: {value!r}")
        if field == "rope_scaling" and raw.get("rope_parameters") not in (None, {}):
            _check_agree(raw, value)
        return field, dict(value)
    return "rope_parameters", {}


def _check_agree(raw: Mapping[str, object], scaling: Mapping[str, object]) -> None:
    """transformers reads ``rope_scaling`` and drops ``rope_parameters`` when both are set; a
    value of ``rope_parameters`` that would be dropped is refused rather than ignored."""
    parameters = raw["rope_parameters"]
    if not isinstance(parameters, dict):
        raise CheckpointError(f"config field 'rope_parameters' is not an object: {parameters!r}")
    effective = dict(scaling)
    effective.setdefault("rope_theta", raw.get("rope_theta"))
    effective.setdefault("rope_type", scaling.get("type", "default"))
    for key, value in parameters.items():
        if effective.get(key) != value:
            raise UnsupportedModel(
                f"config field 'rope_parameters.{key}' is {value!r} but 'rope_scaling' gives "
                f"{effective.get(key)!r}; transformers reads only 'rope_scaling' when both are set"
            )


def _with_top_level(
    raw: Mapping[str, object],
    params: dict[str, object],
    rope_type: str,
    max_position_embeddings: int,
) -> dict[str, object]:
    """Top-level fields folded in as transformers' ``standardize_rope_params`` does."""
    merged = dict(params)
    if raw.get("partial_rotary_factor") is not None:
        merged.setdefault("partial_rotary_factor", raw["partial_rotary_factor"])
    if rope_type in ("yarn", "llama3"):
        if raw.get("original_max_position_embeddings") is not None:
            merged["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
        else:
            merged.setdefault("original_max_position_embeddings", max_position_embeddings)
    return merged


def _positive(field: str, key: str, value: object) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise CheckpointError(
            f"config field '{field}.{key}' must be a positive number, got {value!r}"
        )
    return float(value)


def _number(
    field: str, params: Mapping[str, object], key: str, default: float | None = None
) -> float:
    value = params.get(key)
    if value is None:
        if default is None:
            raise CheckpointError(f"config field '{field}.{key}' is missing")
        return default
    return _positive(field, key, value)


def _optional_number(field: str, params: Mapping[str, object], key: str) -> float | None:
    value = params.get(key)
    return None if value is None else _positive(field, key, value)


def _truncate(field: str, params: Mapping[str, object]) -> bool:
    value = params.get("truncate", True)
    if value is None:
        return True
    if not isinstance(value, bool):
        raise CheckpointError(
            f"config field '{field}.truncate' must be true or false, got {value!r}"
        )
    return value
