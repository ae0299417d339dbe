"""Results of a run with some workloads measured again: ``python -m pagedkv.bench.merge BASE
RERUN --out DIR`` (ENG-234).

A full run takes more than an hour; when some of its workloads were disturbed (the machine
busy with other work), those are run again alone (``--only``) and merged into the full run's
document, rather than the whole run repeated. Each rerun is recorded in the document
(``reruns``) and named in ``results.md``, so the figures say when they were measured.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagedkv.bench import plots
from pagedkv.bench.report import results_markdown
from pagedkv.bench.results import read_json, write_json


def _workload(ratio: str) -> str:
    """The workload a ratio key (``<workload>.<name>``) belongs to."""
    return ratio.split(".", 1)[0]


def _targets(
    base: list[dict[str, Any]], rerun: list[dict[str, Any]], names: set[str]
) -> list[dict[str, Any]]:
    """``base``'s targets with each rerun workload's put where its first one stood (the
    tables keep their order), the rerun's targets of a workload ``base`` had none of last."""
    by_workload: dict[str, list[dict[str, Any]]] = {}
    for target in rerun:
        by_workload.setdefault(_workload(target["ratio"]), []).append(target)
    merged: list[dict[str, Any]] = []
    for target in base:
        workload = _workload(target["ratio"])
        if workload not in names:
            merged.append(target)
        else:
            merged += by_workload.pop(workload, [])
    return merged + [t for targets in by_workload.values() for t in targets]


def merge_rerun(base: dict[str, Any], rerun: dict[str, Any]) -> dict[str, Any]:
    """``base`` with the workloads of ``rerun`` (and their ratios, descriptions and targets)
    replacing its own; a new document, neither argument changed.

    Raises:
        ValueError: the documents' schema versions differ, or ``rerun`` has a workload
            ``base`` lacks (a merge adds no workload the run did not have).
    """
    if base.get("schema_version") != rerun.get("schema_version"):
        raise ValueError(
            f"schema versions differ: {base.get('schema_version')} and "
            f"{rerun.get('schema_version')}"
        )
    names = set(rerun["workloads"])
    extra = sorted(names - set(base["workloads"]))
    if extra:
        raise ValueError(f"the rerun has workloads the run lacks: {', '.join(extra)}")
    merged = dict(base)
    merged["workloads"] = {
        name: rerun["workloads"][name] if name in names else workload
        for name, workload in base["workloads"].items()
    }
    for field in ("ratios", "ratio_descriptions"):
        kept = {k: v for k, v in base[field].items() if _workload(k) not in names}
        merged[field] = kept | dict(rerun[field])
    merged["targets"] = _targets(base["targets"], rerun["targets"], names)
    machine = rerun.get("machine", {})
    merged["reruns"] = [
        *base.get("reruns", []),
        {
            "workloads": sorted(names),
            "date": rerun.get("date"),
            "runtime_s": rerun.get("runtime_s"),
            "load_average_start": machine.get("load_average_start"),
            "load_average_end": machine.get("load_average_end"),
        },
    ]
    return merged


def main(argv: Sequence[str] | None = None) -> int:
    """Write the merged results.json and results.md (and the plots, where matplotlib is
    installed) under ``--out``; returns the exit status (2: a document cannot be merged)."""
    parser = argparse.ArgumentParser(prog="python -m pagedkv.bench.merge", description=__doc__)
    parser.add_argument("base", type=Path, help="the full run's results.json")
    parser.add_argument("rerun", type=Path, help="results.json of the workloads run again")
    parser.add_argument("--out", type=Path, required=True, help="folder to write into")
    parser.add_argument("--no-plots", action="store_true", help="do not draw the PNG plots")
    args = parser.parse_args(argv)
    try:
        document = merge_rerun(read_json(args.base), read_json(args.rerun))
    except ValueError as error:
        print(f"cannot merge: {error}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(document, args.out / "results.json")
    (args.out / "results.md").write_text(results_markdown(document), encoding="utf-8")
    if not args.no_plots and plots.available():
        plots.write_plots(document, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
