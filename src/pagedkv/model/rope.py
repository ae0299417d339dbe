"""Rotary position embedding: the inverse frequencies of each rope type, and the cos/sin tables.

Numerics follow transformers' ``ROPE_INIT_FUNCTIONS`` and Qwen3's rotary module: frequencies
are computed once in float32 on the CPU, angles ``position * inv_freq`` in float32, and
``cos``/``sin`` are multiplied by the type's attention factor (YaRN's ``mscale``; 1 for the
others) before they are cast to the activation dtype. All supported types have fixed
frequencies, so a position's table never depends on the step it is computed in.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedkv.errors import InvalidRequest
from pagedkv.model.rope_config import RopeConfig

#: Frequencies are computed on the CPU even while a model is built on the meta device.
_CPU = torch.device("cpu")


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim / 2] float32 on the CPU, attention factor)`` of ``rope``.

    Args:
        rope: a supported rope configuration.
        head_dim: channels per head, even.
    """
    if rope.rope_type == "proportional":
        return _proportional(rope, head_dim), 1.0
    inv_freq = 1.0 / (rope.theta ** _exponents(head_dim))
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3(rope, inv_freq), 1.0
    return _yarn(rope, head_dim), _yarn_attention_factor(rope)


def _exponents(head_dim: int) -> torch.Tensor:
    """``2i / head_dim`` for ``i < head_dim / 2``, float32."""
    return torch.arange(0, head_dim, 2, dtype=torch.int64, device=_CPU).to(torch.float32) / head_dim


def _proportional(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """The first ``partial_rotary_factor`` of the angle pairs rotate (exponents over the whole
    head), the rest get frequency 0; all divided by ``factor``."""
    rotated = int(rope.partial_rotary_factor * head_dim // 2)
    steps = (
        torch.arange(0, 2 * rotated, 2, dtype=torch.int64, device=_CPU).to(torch.float32) / head_dim
    )
    inv_freq = 1.0 / (rope.theta**steps)
    inv_freq = torch.cat(
        (inv_freq, torch.zeros(head_dim // 2 - rotated, dtype=torch.float32, device=_CPU))
    )
    return inv_freq / rope.factor


def _llama3(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama 3.1: wavelengths longer than ``original / low_freq_factor`` divided by
    ``factor``, shorter than ``original / high_freq_factor`` kept, those between blended."""
    original = _original(rope)
    low_factor, high_factor = rope.low_freq_factor, rope.high_freq_factor
    if low_factor is None or high_factor is None:
        raise InvalidRequest("rope_type 'llama3' needs low_freq_factor and high_freq_factor")
    low_wavelen = original / low_factor
    high_wavelen = original / high_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (original / wavelen - low_factor) / (high_factor - low_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def _original(rope: RopeConfig) -> int:
    if rope.original_max_position_embeddings is None:
        raise InvalidRequest(f"rope_type {rope.rope_type!r} needs original_max_position_embeddings")
    return rope.original_max_position_embeddings


def _yarn(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """YaRN: high-frequency pairs extrapolate (unscaled), low-frequency pairs interpolate
    (divided by ``factor``), with a linear ramp between the correction dimensions of
    ``beta_fast`` and ``beta_slow`` rotations over ``original_max_position_embeddings``."""
    original = _original(rope)

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low = correction_dim(rope.beta_fast)
    high = correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # the ramp's width must not be zero
    pos_freqs = rope.theta ** _exponents(head_dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (rope.factor * pos_freqs)
    ramp = torch.clamp(
        (torch.arange(head_dim // 2, dtype=torch.float32, device=_CPU) - low) / (high - low), 0, 1
    )
    extrapolation_share = 1 - ramp
    return interpolation * (1 - extrapolation_share) + extrapolation * extrapolation_share


def _yarn_attention_factor(rope: RopeConfig) -> float:
    """The explicit ``attention_factor``, else ``mscale(factor, mscale) /
    mscale(factor, mscale_all_dim)`` when both are set, else ``0.1 ln(factor) + 1``."""
    if rope.attention_factor is not None:
        return rope.attention_factor

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim)
    return mscale(rope.factor)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding tables for given positions.

    The inverse frequencies are computed once, in float32 on the CPU, and are not parameters:
    a model built on the meta device still has them.

    Args:
        rope: the rope configuration.
        head_dim: channels per head, even.
    """

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self._inv_freq_cpu, self.attention_factor = inverse_frequencies(rope, head_dim)
        self._inv_freq_by_device: dict[torch.device, torch.Tensor] = {}

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        cached = self._inv_freq_by_device.get(device)
        if cached is None:
            cached = self._inv_freq_cpu.to(device)
            self._inv_freq_by_device[device] = cached
        return cached

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` tables for ``positions``.

        Args:
            positions: ``[T]`` int64 token positions.
            dtype: the activation dtype the tables are cast to.

        Returns:
            ``(cos, sin)``, each ``[T, head_dim]``.
        """
        freqs = positions.to(torch.float32)[:, None] * self._inv_freq(positions.device)[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)
