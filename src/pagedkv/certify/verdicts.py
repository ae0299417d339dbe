"""What a check concludes: a verdict, the first divergence when there is one, and the request
that reproduces it (CRT-001, CRT-002)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol


class Verdict(StrEnum):
    """A check's verdict: ``tie`` and ``skip`` are not failures (CRT-003)."""

    PASS = "pass"
    FAIL = "fail"
    TIE = "tie"
    SKIP = "skip"


@dataclass(frozen=True, slots=True)
class Divergence:
    """The first token where the server's text leaves the reference's.

    Attributes:
        index: position of the diverging token among the generated tokens (0: the first).
        reference_token: the reference's token id there.
        reference_text: the reference's text from that token on.
        server_text: the server's text from the same character on.
        margin: the reference's top-1 minus top-2 logit at that token (logit units).
    """

    index: int
    reference_token: int
    reference_text: str
    server_text: str
    margin: float


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One check's outcome.

    Attributes:
        name: the check's name.
        spec_ids: the requirements it certifies.
        capability: what the server must offer for the check to be asked.
        verdict: pass, fail, tie or skip.
        detail: one line saying why.
        divergence: the first diverging token, for a greedy mismatch.
        request: the exact request body that reproduces a fail or tie (JSON-able).
    """

    name: str
    spec_ids: tuple[str, ...]
    capability: str
    verdict: Verdict
    detail: str
    divergence: Divergence | None = None
    request: dict[str, Any] | None = field(default=None)

    @property
    def failed(self) -> bool:
        return self.verdict is Verdict.FAIL


class Described(Protocol):
    """What a result names of its check."""

    name: str
    spec_ids: tuple[str, ...]
    capability: str


def result_of(
    check: Described,
    verdict: Verdict,
    detail: str,
    request: dict[str, Any] | None = None,
    divergence: Divergence | None = None,
) -> CheckResult:
    """``check``'s result: its name, spec IDs and capability with this verdict."""
    return CheckResult(
        check.name, check.spec_ids, check.capability, verdict, detail, divergence, request
    )
