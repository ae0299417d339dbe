"""The CI regression gate: every gated ratio of a run must reach its floor in bench/floors.json.

Floors are ratios measured in the same run against an alternative, never absolute times, so
they hold on any machine; each is set below the median of several quick runs with a margin for
a noisy machine (the file records the median and the margin). A ratio that is missing or not
measured fails too: a gate that silently skips is no gate.

``python -m pagedkv_bench.gate RESULTS FLOORS`` checks an existing results.json; the
harness's ``--gate FLOORS`` option (``python -m pagedkv_bench``) checks the run it just
made.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedkv.bench.results import read_json


@dataclass(frozen=True, slots=True)
class GateFailure:
    """A gated ratio below its floor (or missing).

    Attributes:
        ratio: the ratio's name.
        value: its value in the results, ``None`` if missing or not measured.
        floor: the floor it must reach.
        description: what the ratio measures.
    """

    ratio: str
    value: float | None
    floor: float
    description: str

    def message(self) -> str:
        """One line naming the ratio, its value and its floor."""
        if self.value is None:
            return f"{self.ratio} was not measured (floor {self.floor:.3g}): {self.description}"
        return (
            f"{self.ratio} = {self.value:.3g} is below its floor {self.floor:.3g}: "
            f"{self.description}"
        )


def check_floors(results: dict[str, Any], floors: dict[str, Any]) -> list[GateFailure]:
    """Every gated ratio of ``results`` below its floor in ``floors``.

    Raises:
        ValueError: ``floors`` is malformed, or was set for another mode than ``results``.
    """
    entries = floors.get("floors")
    if not isinstance(entries, dict) or not entries:
        raise ValueError("the floors file has no 'floors' object of ratio -> {floor: ...}")
    mode = floors.get("mode")
    if mode is not None and results.get("mode") != mode:
        raise ValueError(
            f"the floors are for {mode} mode results, these are {results.get('mode')} mode"
        )
    ratios = results.get("ratios", {})
    descriptions = results.get("ratio_descriptions", {})
    failures = []
    for name, entry in entries.items():
        floor = entry.get("floor") if isinstance(entry, dict) else None
        if not isinstance(floor, int | float):
            raise ValueError(f"floor of {name!r} must be a number, got {floor!r}")
        value = ratios.get(name)
        measured = isinstance(value, int | float) and not math.isnan(value)
        if not measured or value < floor:
            failures.append(
                GateFailure(
                    name,
                    float(value) if measured else None,
                    float(floor),
                    descriptions.get(name, ""),
                )
            )
    return failures


def report(results: dict[str, Any], floors: dict[str, Any]) -> int:
    """Print the gate's verdict; 0 if every floor is met, 1 otherwise."""
    try:
        failures = check_floors(results, floors)
    except ValueError as exc:
        print(f"bench-gate: error: {exc}", file=sys.stderr)
        return 1
    ratios = results.get("ratios", {})
    for name, entry in floors["floors"].items():
        value = ratios.get(name)
        shown = "n/a" if value is None else f"{value:.3g}"
        print(f"bench-gate: {name} = {shown} (floor {entry['floor']:.3g})")
    for failure in failures:
        print(f"bench-gate: FAIL: {failure.message()}", file=sys.stderr)
    if failures:
        print(f"bench-gate: {len(failures)} ratio(s) below their floor", file=sys.stderr)
        return 1
    print(f"bench-gate: all {len(floors['floors'])} floors met")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pagedkv_bench.gate RESULTS FLOORS``: exit 0 if every floor is met, else 1."""
    parser = argparse.ArgumentParser(
        prog="python -m pagedkv_bench.gate",
        description="Check a benchmark results.json against a floors file.",
    )
    parser.add_argument("results", type=Path, help="results.json of a --quick run")
    parser.add_argument("floors", type=Path, help="floors file, e.g. bench/floors.json")
    args = parser.parse_args(argv)
    try:
        results, floors = read_json(args.results), read_json(args.floors)
    except (OSError, ValueError) as exc:
        print(f"bench-gate: error: cannot read {exc}", file=sys.stderr)
        return 1
    return report(results, floors)


if __name__ == "__main__":
    sys.exit(main())
