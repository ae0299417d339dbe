"""The benchmark regression gate fails on a ratio below its floor and passes otherwise.

Results are fabricated: the gate is tested without running the benchmarks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pagedkv.bench.report import results_markdown, results_table
from pagedkv.bench.results import WorkloadResult, build_document, read_json
from pagedkv_bench import gate

FLOORS_FILE = Path(__file__).resolve().parents[1] / "bench" / "floors.json"


def fabricated_results(**overrides: float | None) -> dict[str, Any]:
    """A quick-mode results document whose ratios all clear the shipped floors."""
    floors = read_json(FLOORS_FILE)["floors"]
    ratios: dict[str, float | None] = {name: entry["floor"] * 1.5 for name, entry in floors.items()}
    ratios.update(overrides)
    return {
        "schema_version": 1,
        "mode": "quick",
        "ratios": ratios,
        "ratio_descriptions": {name: f"what {name} measures" for name in ratios},
    }


def floors_of(**floors: float) -> dict[str, Any]:
    return {"mode": "quick", "floors": {name: {"floor": f} for name, f in floors.items()}}


def test_shipped_floors_gate_the_four_required_ratios() -> None:
    floors = read_json(FLOORS_FILE)
    assert floors["mode"] == "quick"
    assert set(floors["floors"]) >= {
        "mixed.v1_vs_v0_speedup",
        "shared_prefix.prefill_saved_vs_ideal",
        "memory.kv_utilisation",
        "mixed.pagedkv_vs_hf_generate",
    }
    for entry in floors["floors"].values():
        assert 0 < entry["floor"] <= entry["measured_median"]


def test_passes_when_every_floor_is_met(capsys: pytest.CaptureFixture[str]) -> None:
    results = fabricated_results()
    assert gate.check_floors(results, read_json(FLOORS_FILE)) == []
    assert gate.report(results, read_json(FLOORS_FILE)) == 0
    assert "floors met" in capsys.readouterr().out


def test_a_value_equal_to_its_floor_passes() -> None:
    assert not gate.check_floors(
        {"mode": "quick", "ratios": {"a.b": 2.0}}, floors_of(**{"a.b": 2.0})
    )


def test_fails_naming_the_ratio_its_value_and_its_floor(
    capsys: pytest.CaptureFixture[str],
) -> None:
    results = fabricated_results(**{"mixed.v1_vs_v0_speedup": 1.25})
    floors = read_json(FLOORS_FILE)
    failures = gate.check_floors(results, floors)
    assert [f.ratio for f in failures] == ["mixed.v1_vs_v0_speedup"]
    assert gate.report(results, floors) == 1
    err = capsys.readouterr().err
    floor = floors["floors"]["mixed.v1_vs_v0_speedup"]["floor"]
    assert f"FAIL: mixed.v1_vs_v0_speedup = 1.25 is below its floor {floor:.3g}" in err


def test_an_impossible_floor_fails() -> None:
    results = fabricated_results()
    floors = floors_of(**{"memory.kv_utilisation": 1e9})
    failures = gate.check_floors(results, floors)
    assert len(failures) == 1
    assert "memory.kv_utilisation" in failures[0].message()
    assert "1e+09" in failures[0].message()


@pytest.mark.parametrize("value", [None, float("nan")])
def test_a_ratio_not_measured_fails(value: float | None) -> None:
    results = fabricated_results(**{"shared_prefix.prefill_saved_vs_ideal": value})
    failures = gate.check_floors(results, read_json(FLOORS_FILE))
    assert [f.ratio for f in failures] == ["shared_prefix.prefill_saved_vs_ideal"]
    assert "was not measured" in failures[0].message()


def test_a_missing_ratio_fails() -> None:
    results = fabricated_results()
    del results["ratios"]["memory.kv_utilisation"]
    failures = gate.check_floors(results, read_json(FLOORS_FILE))
    assert [f.ratio for f in failures] == ["memory.kv_utilisation"]


def test_floors_of_another_mode_are_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    results = fabricated_results()
    results["mode"] = "full"
    with pytest.raises(ValueError, match="quick mode"):
        gate.check_floors(results, read_json(FLOORS_FILE))
    assert gate.report(results, read_json(FLOORS_FILE)) == 1
    assert "error" in capsys.readouterr().err


def test_malformed_floors_are_an_error() -> None:
    with pytest.raises(ValueError, match="floors"):
        gate.check_floors(fabricated_results(), {"mode": "quick"})
    with pytest.raises(ValueError, match="number"):
        gate.check_floors(fabricated_results(), {"floors": {"a.b": {"floor": "high"}}})


def test_command_line_exit_status(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(fabricated_results()))
    bad.write_text(json.dumps(fabricated_results(**{"mixed.pagedkv_vs_hf_generate": 0.1})))
    assert gate.main([str(good), str(FLOORS_FILE)]) == 0
    assert gate.main([str(bad), str(FLOORS_FILE)]) == 1
    assert gate.main([str(tmp_path / "missing.json"), str(FLOORS_FILE)]) == 1


def test_results_document_and_tables_from_a_workload() -> None:
    workload = WorkloadResult("mixed")
    workload.add_ratio("pagedkv_vs_hf_generate", 2.5, "tokens/s over tokens/s")
    workload.add_target("pagedkv_vs_hf_generate", ">=", 2.0, "pagedkv >= 2x generate")
    workload.add_ratio("not_measured", float("nan"), "nothing")
    document = build_document(
        mode="quick",
        machine={"cpu_model": "test"},
        settings={},
        workloads=[workload],
        runtime_s=1.0,
    )
    json.dumps(document, allow_nan=False)  # NaN is written as null
    assert document["ratios"] == {
        "mixed.pagedkv_vs_hf_generate": 2.5,
        "mixed.not_measured": None,
    }
    assert document["targets"][0]["met"] is True
    table = results_table(document)
    assert "| pagedkv >= 2x generate | `mixed.pagedkv_vs_hf_generate` | 2.5 | >= 2 | yes |" in table
    assert "# pagedkv benchmark results" in results_markdown(document)
