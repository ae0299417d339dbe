"""The report of a certify run, as JSON and Markdown (CRT-002, CRT-003)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pagedkv.certify.verdicts import CheckResult, Verdict

#: File names the report is written to, in the output directory.
JSON_NAME = "certify.json"
MARKDOWN_NAME = "certify.md"


@dataclass(frozen=True, slots=True)
class CertifyReport:
    """Every check's result of one run.

    Attributes:
        url: the server's base URL.
        model: the checkpoint directory the reference was computed from.
        served_model: the name requests gave as ``model``.
        profile: ``quick`` or ``full``.
        results: one per check, in the order they ran.
    """

    url: str
    model: str
    served_model: str
    profile: str
    results: tuple[CheckResult, ...]

    @property
    def passed(self) -> bool:
        """No check failed (ties and skips are not failures)."""
        return not any(r.failed for r in self.results)

    @property
    def exit_status(self) -> int:
        """0 when :attr:`passed`, else 1."""
        return 0 if self.passed else 1

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-able data."""
        return {
            "url": self.url,
            "model": self.model,
            "served_model": self.served_model,
            "profile": self.profile,
            "passed": self.passed,
            "results": [_result_json(r) for r in self.results],
        }

    def to_markdown(self) -> str:
        """The report as Markdown: a table of verdicts, then each fail's and tie's details."""
        lines = [
            f"# pagedkv certify: {'PASS' if self.passed else 'FAIL'}",
            "",
            f"Server `{self.url}` serving `{self.served_model}`, reference `{self.model}`, "
            f"profile `{self.profile}`.",
            "",
            "| check | spec | verdict | detail |",
            "|---|---|---|---|",
        ]
        for r in self.results:
            detail = r.detail.replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {r.name} | {', '.join(r.spec_ids)} | {r.verdict.value} | {detail} |")
        for r in self.results:
            if r.verdict not in (Verdict.FAIL, Verdict.TIE):
                continue
            lines += ["", f"## {r.name}: {r.verdict.value}", "", f"Capability: {r.capability}."]
            if r.divergence is not None:
                d = r.divergence
                lines += [
                    "",
                    f"First diverging token: index {d.index} (reference token id "
                    f"{d.reference_token}), reference top-2 margin {d.margin:.6g}.",
                    "",
                    f"- reference text from there: `{d.reference_text!r}`",
                    f"- server text from there: `{d.server_text!r}`",
                ]
            if r.request is not None:
                lines += ["", "Request that reproduces it:", "", "```json"]
                lines += [json.dumps(r.request), "```"]
        return "\n".join(lines) + "\n"

    def write(self, out_dir: str | Path) -> tuple[Path, Path]:
        """Write ``certify.json`` and ``certify.md`` into ``out_dir`` (created if needed);
        returns their paths."""
        directory = Path(out_dir)
        directory.mkdir(parents=True, exist_ok=True)
        json_path = directory / JSON_NAME
        markdown_path = directory / MARKDOWN_NAME
        json_path.write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")
        markdown_path.write_text(self.to_markdown(), encoding="utf-8")
        return json_path, markdown_path


def _result_json(result: CheckResult) -> dict[str, Any]:
    data = asdict(result)
    data["verdict"] = result.verdict.value
    data["spec_ids"] = list(result.spec_ids)
    return data
