"""A model's sampling defaults from its ``generation_config.json`` (vLLM's
``--generation-config``).

Qwen3 ships ``temperature 0.6, top_p 0.95, top_k 20``: a request that does not set a field gets
the model's value, then the library's (ENG-080). As in vLLM, only the sampling fields are read
(``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and
``max_new_tokens`` as ``max_tokens``); ``do_sample`` and the rest are not sampling defaults.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedkv.engine.params import SamplingParams
from pagedkv.errors import CheckpointError, InvalidRequest

#: ``generation_config.json`` key of each default, by the SamplingParams field it fills.
KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_tokens": "max_new_tokens",
}
#: ``--generation-config`` values: the model's defaults, or none (vLLM's name for its own).
AUTO, NONE = "auto", "vllm"


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """Sampling defaults; ``None`` fields leave the library's default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    @classmethod
    def from_dir(cls, directory: str | Path, *, required: bool = False) -> GenerationDefaults:
        """The defaults of ``directory/generation_config.json``; none if the file is absent
        (an error if ``required``).

        Raises:
            CheckpointError: an unreadable file, or a value of the wrong type (named).
        """
        path = Path(directory) / "generation_config.json"
        if not path.exists():
            if required:
                raise CheckpointError(f"{path} does not exist")
            return cls()
        try:
            config: Any = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: {exc}") from exc
        if not isinstance(config, dict):
            raise CheckpointError(f"{path}: expected a JSON object")
        values: dict[str, float | int] = {}
        for name, key in KEYS.items():
            value = config.get(key)
            if value is None:
                continue
            integral = name in ("top_k", "max_tokens")
            wrong = isinstance(value, bool) or not isinstance(value, int | float)
            if wrong or (integral and not isinstance(value, int)) or not math.isfinite(value):
                raise CheckpointError(f"{path}: {key} must be a number, got {value!r}")
            values[name] = value
        return cls(**values)  # type: ignore[arg-type]

    @classmethod
    def load(cls, source: str | Path, model_dir: str | Path) -> GenerationDefaults:
        """The defaults ``--generation-config`` names: ``auto`` (the model's), ``vllm`` (none)
        or a directory holding a ``generation_config.json``.

        Raises:
            CheckpointError: a named directory without a readable generation config.
        """
        if str(source) == AUTO:
            return cls.from_dir(model_dir)
        if str(source) == NONE:
            return cls()
        return cls.from_dir(source, required=True)

    def values(self) -> dict[str, float | int]:
        """The defaults set, by SamplingParams field."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }

    def sampling_params(self, **fields: Any) -> SamplingParams:
        """SamplingParams from ``fields``; a field absent or ``None`` takes the model's
        default, then the library's.

        Raises:
            InvalidSamplingParams: a value out of range (the model's included).
            InvalidRequest: a field SamplingParams does not have.
        """
        given = {k: v for k, v in fields.items() if v is not None}
        known = {f.name for f in dataclasses.fields(SamplingParams)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise InvalidRequest(f"unknown sampling fields: {', '.join(unknown)}")
        return SamplingParams(**{**self.values(), **given})
