"""A run's results with some workloads measured again (ENG-234)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from pagedkv.bench.merge import main, merge_rerun
from pagedkv.bench.report import results_markdown


def _document(date: str, workloads: dict[str, dict[str, float]]) -> dict[str, Any]:
    """A results document: ``workloads`` maps each name to its ratios; each ratio has a
    target of ``>= 1.0``."""
    ratios = {f"{w}.{r}": v for w, rs in workloads.items() for r, v in rs.items()}
    return {
        "schema_version": 1,
        "mode": "full",
        "date": date,
        "runtime_s": 10.0,
        "machine": {
            "cpu_model": "Xeon",
            "cores": 2,
            "load_average_start": [0.1, 0.2, 0.3],
            "load_average_end": [2.0, 1.0, 0.5],
        },
        "settings": {},
        "ratios": ratios,
        "ratio_descriptions": {k: f"{k} of {date}" for k in ratios},
        "targets": [
            {
                "ratio": k,
                "op": ">=",
                "threshold": 1.0,
                "description": k,
                "value": v,
                "met": v >= 1.0,
            }
            for k, v in ratios.items()
        ],
        "workloads": {
            w: {"seconds": 1.0, "figures": {"date": date}, "notes": [], "errors": {}}
            for w in workloads
        },
    }


BASE = _document("2026-12-01", {"mixed": {"a": 0.5, "b": 0.9}, "decode": {"c": 2.0}})
RERUN = _document("2026-12-02", {"mixed": {"a": 1.5}})


@pytest.mark.spec("ENG-234")
def test_the_rerun_replaces_its_workloads_and_nothing_else() -> None:
    """Catches a stale figure kept (the old ``mixed.b``, which the rerun no longer has, its
    description or its target), a rerun figure dropped, or another workload touched."""
    base, rerun = copy.deepcopy(BASE), copy.deepcopy(RERUN)
    merged = merge_rerun(base, rerun)
    assert merged["ratios"] == {"mixed.a": 1.5, "decode.c": 2.0}
    assert merged["ratio_descriptions"] == {
        "mixed.a": "mixed.a of 2026-12-02",
        "decode.c": "decode.c of 2026-12-01",
    }
    assert [(t["ratio"], t["value"], t["met"]) for t in merged["targets"]] == [
        ("mixed.a", 1.5, True),  # where mixed's targets stood: the tables keep their order
        ("decode.c", 2.0, True),
    ]
    assert merged["workloads"]["mixed"]["figures"] == {"date": "2026-12-02"}
    assert merged["workloads"]["decode"]["figures"] == {"date": "2026-12-01"}
    assert merged["date"] == "2026-12-01"
    assert (base, rerun) == (BASE, RERUN)  # neither argument changed


@pytest.mark.spec("ENG-234")
def test_each_rerun_is_recorded_and_named_in_results_md() -> None:
    """Catches a merge that hides when its figures were measured."""
    twice = merge_rerun(merge_rerun(BASE, RERUN), _document("2026-12-03", {"decode": {"c": 3}}))
    assert [(r["workloads"], r["date"]) for r in twice["reruns"]] == [
        (["mixed"], "2026-12-02"),
        (["decode"], "2026-12-03"),
    ]
    assert twice["reruns"][0]["load_average_end"] == [2.0, 1.0, 0.5]
    text = results_markdown(twice)
    assert "- CPU: Xeon, 2 cores usable" in text  # the run's own machine, as before
    assert "The figures of `mixed` are from a run of those workloads alone on 2026-12-02" in text
    assert "The figures of `decode` are from a run of those workloads alone on 2026-12-03" in text


@pytest.mark.spec("ENG-234")
@pytest.mark.parametrize(
    ("rerun", "message"),
    [
        (_document("d", {"tp": {"x": 1.0}}), "the rerun has workloads the run lacks: tp"),
        ({**RERUN, "schema_version": 2}, "schema versions differ: 1 and 2"),
    ],
)
def test_a_rerun_that_does_not_fit_is_refused(rerun: dict[str, Any], message: str) -> None:
    """Catches a workload the run never had added, or documents of two schemas mixed."""
    with pytest.raises(ValueError, match=message):
        merge_rerun(BASE, rerun)


@pytest.mark.spec("ENG-234")
def test_the_command_writes_results_json_and_md(tmp_path: Path) -> None:
    """Catches the command line not writing what it merged, or not refusing a bad rerun."""
    (tmp_path / "base.json").write_text(json.dumps(BASE))
    (tmp_path / "rerun.json").write_text(json.dumps(RERUN))
    out = tmp_path / "out"
    assert (
        main(
            [
                str(tmp_path / "base.json"),
                str(tmp_path / "rerun.json"),
                "--out",
                str(out),
                "--no-plots",
            ]
        )
        == 0
    )
    assert json.loads((out / "results.json").read_text()) == merge_rerun(BASE, RERUN)
    assert "`mixed`" in (out / "results.md").read_text()
    (tmp_path / "bad.json").write_text(json.dumps(_document("d", {"tp": {"x": 1.0}})))
    assert main([str(tmp_path / "base.json"), str(tmp_path / "bad.json"), "--out", str(out)]) == 2
