"""The results of a run: per-workload figures, named ratios, targets, and the JSON document.

Ratio names are ``<workload>.<ratio>``; each is higher-is-better unless its target says
``<=``. The JSON layout is documented in ``bench/README.md``.
"""

from __future__ import annotations

import datetime
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pagedkv.bench.stats import rounded

#: Version of the results.json layout; bump it when a field changes meaning.
SCHEMA_VERSION = 1

Comparison = Literal[">=", "<="]


@dataclass(frozen=True, slots=True)
class Target:
    """A goal for one ratio, e.g. ``mixed.pagedkv_vs_hf_generate >= 2.0``.

    Attributes:
        ratio: the ratio's name.
        op: ``>=`` (the ratio must reach ``threshold``) or ``<=`` (must not exceed it).
        threshold: the goal.
        description: what meeting it means, one line.
    """

    ratio: str
    op: Comparison
    threshold: float
    description: str

    def met(self, value: float | None) -> bool | None:
        """Whether ``value`` meets the target; ``None`` when it was not measured."""
        if value is None or math.isnan(value):
            return None
        return value >= self.threshold if self.op == ">=" else value <= self.threshold


@dataclass
class WorkloadResult:
    """What one workload measured.

    Attributes:
        name: the workload, e.g. ``mixed``.
        figures: JSON-ready measurements (tokens/s, ms, counts, per-system summaries).
        ratios: ratio name (``<workload>.<name>``) to value; NaN when not measured.
        descriptions: ratio name to a one-line description with its units.
        targets: goals for some of the ratios.
        notes: remarks, e.g. why a system was skipped.
        errors: system or step name to the error string it raised.
        seconds: wall time the workload took, seconds.
    """

    name: str
    figures: dict[str, Any] = field(default_factory=dict)
    ratios: dict[str, float] = field(default_factory=dict)
    descriptions: dict[str, str] = field(default_factory=dict)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def add_ratio(self, name: str, value: float, description: str) -> None:
        """Record ``<workload>.<name>``."""
        key = f"{self.name}.{name}"
        self.ratios[key] = value
        self.descriptions[key] = description

    def add_target(self, name: str, op: Comparison, threshold: float, description: str) -> None:
        """A goal for the ratio ``<workload>.<name>``."""
        self.targets.append(Target(f"{self.name}.{name}", op, threshold, description))


def build_document(
    *,
    mode: str,
    machine: dict[str, Any],
    settings: dict[str, Any],
    workloads: list[WorkloadResult],
    runtime_s: float,
) -> dict[str, Any]:
    """The results.json document of a run."""
    ratios = {k: rounded(v) for w in workloads for k, v in w.ratios.items()}
    targets = []
    for workload in workloads:
        for target in workload.targets:
            value = ratios.get(target.ratio)
            targets.append(
                {
                    "ratio": target.ratio,
                    "op": target.op,
                    "threshold": target.threshold,
                    "description": target.description,
                    "value": value,
                    "met": target.met(value),
                }
            )
    return {
        "schema_version": SCHEMA_VERSION,
        "mode": mode,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "runtime_s": round(runtime_s, 1),
        "machine": machine,
        "settings": settings,
        "ratios": ratios,
        "ratio_descriptions": {k: v for w in workloads for k, v in w.descriptions.items()},
        "targets": targets,
        "workloads": {
            w.name: {
                "seconds": round(w.seconds, 1),
                "figures": w.figures,
                "notes": w.notes,
                "errors": w.errors,
            }
            for w in workloads
        },
    }


def write_json(document: dict[str, Any], path: Path) -> None:
    """Write ``document`` as indented JSON (NaN is never written: ratios use ``null``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(document, indent=2, allow_nan=False, sort_keys=False)
    path.write_text(text + "\n", encoding="utf-8")


def read_json(path: Path) -> dict[str, Any]:
    """Read a results or floors document."""
    document: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return document
